"""A fleet as deployed (Redis, `tokenfleet scheduler`, `tokenfleet gateway`, each its own process)
on the default model in float32, for the clients that people point at vLLM: they run their own
HTTP stacks (sync or on their own loops), so the fleet cannot live in the test's event loop."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.processes import Children, start_gateway, start_scheduler
from tokenfleet.redis_server import RedisServer


@dataclass
class Fleet:
    url: str  # the gateway's base URL, without /v1
    model: str  # the served name
    folder: Path  # the checkpoint (its tokenizer, for clients that tokenize themselves)


@pytest.fixture(scope="session")
def client_fleet(smollm2, tmp_path_factory) -> Fleet:
    root = tmp_path_factory.mktemp("client-fleet")
    redis = RedisServer(root / "redis")
    redis.start()
    children = Children(root / "logs")
    try:
        start_scheduler(children, redis.url, smollm2, "--dtype", "float32", "--device", "cpu",
                        "--num-kv-blocks", "512", "--max-num-seqs", "8", scheduler_id="clients-1")
        url, _ = start_gateway(children, redis.url, smollm2)
        yield Fleet(url, smollm2.name, smollm2)
    finally:
        children.stop()
        redis.stop()
