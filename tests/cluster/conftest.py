"""A real local Redis Cluster (3 primaries, 3 replicas, Debian's redis-server 7) for the
cluster tests: `-m cluster` selects them. Skipped where no redis-server 7 is installed, unless
CI is set (scripts/test installs it where it can)."""

from __future__ import annotations

import os
import shutil

import pytest

from tokenfleet.redis_cluster import RedisCluster


def _require_redis_7() -> None:
    from tokenfleet.redis_cluster import cluster_server_binary

    try:
        cluster_server_binary()
    except RuntimeError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """One cluster per test module (it starts in about 3 s)."""
    _require_redis_7()
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def fresh_cluster(tmp_path):
    """A cluster of the test's own (for the tests that kill its nodes)."""
    _require_redis_7()
    cluster = RedisCluster(tmp_path / "cluster")
    cluster.start()
    yield cluster
    cluster.stop()
