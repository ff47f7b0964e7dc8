"""`tokenfleet up --redis-cluster 3`: a local 3+3 Redis Cluster under the fleet, which serves a
chat on it; `tokenfleet status` shows every shard; a killed node is restarted and rejoins."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from shared.net import free_port
from tests.cluster.conftest import _require_redis_7
from tests.fleet_helpers import TINY_CHAT, UpProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_up_with_a_redis_cluster_serves_and_status_shows_every_shard(tiny_chat, tmp_path):
    _require_redis_7()
    port = free_port()
    home = tmp_path / "home"
    up = UpProcess(["--port", str(port), "--model", str(tiny_chat), "--num-kv-blocks", "128",
                    "--dtype", "float32", "--redis-cluster", "3"], home)
    try:
        up.wait_up()
        fleet = json.loads((home / "fleet.json").read_text())
        assert fleet["redis_url"].startswith("redis+cluster://") and fleet["redis_url"].count(",") == 5
        body = json.dumps({"model": TINY_CHAT, "max_tokens": 8, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hello"}]})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read())["choices"][0]["finish_reason"] in ("stop", "length")
        deadline = time.monotonic() + 30
        while True:  # (status finds the fleet's Redis in fleet.json)
            status = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "status"], env=up.env,
                                    capture_output=True, text=True, timeout=60)
            assert status.returncode == 0, status.stderr
            shards = [line for line in status.stdout.splitlines() if "(online)" in line]
            if len(shards) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(shards) == 3, status.stdout
    finally:
        assert up.stop() == 0, up.output[-3000:]
    assert not (home / "fleet.json").exists()
