"""`tokenfleet up`'s engine flags reach the scheduler process it starts: read back from the
scheduler's heartbeat (tf:sched:{id}) in the fleet's real Redis."""

from __future__ import annotations

import json
import time

import pytest
import redis

from shared.net import free_port
from tests.fleet_helpers import KEYS, TINY_CHAT, UpProcess

pytestmark = pytest.mark.slow


def test_ups_engine_flags_reach_the_schedulers_heartbeat(tiny_chat, tmp_path) -> None:
    home = tmp_path / "home"
    up = UpProcess(["--port", str(free_port()), "--model", str(tiny_chat), "--dtype", "float32",
                    "--gateway-workers", "1", "--num-kv-blocks", "64",
                    "--max-num-batched-tokens", "1024", "--block-size", "32", "--max-model-len", "512",
                    "--device", "cpu"], home)
    try:
        up.wait_up()
        client = redis.Redis.from_url(json.loads((home / "fleet.json").read_text())["redis_url"])
        key = KEYS.scheduler(f"{TINY_CHAT}-0")
        deadline = time.monotonic() + 60
        while not client.exists(key):  # (/ready needs the heartbeat, but not of this id)
            assert time.monotonic() < deadline, f"no heartbeat at {key}"
            time.sleep(0.1)
        beat = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
        assert {name: beat.get(name) for name in ("max_num_batched_tokens", "block_size", "max_model_len",
                                                  "device", "num_kv_blocks")} == \
            {"max_num_batched_tokens": "1024", "block_size": "32", "max_model_len": "512", "device": "cpu",
             "num_kv_blocks": "64"}, beat
    finally:
        assert up.stop() == 0, up.output[-3000:]
