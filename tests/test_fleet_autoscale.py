"""`tokenfleet up --min-replicas 1 --max-replicas 2`: a burst grows the fleet, low load shrinks it
back by draining a replica that still streams, and no request is cut, repeated or lost."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from protocol import registry
from protocol.keys import Keys
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.net import free_port
from shared.sampling import SamplingParams
from testkit.sse import DONE, data_of
from tests.fleet_helpers import UpProcess

pytestmark = pytest.mark.slow
KEYS = Keys()
MODEL = "tiny"
SHORT_TOKENS = 64  # the burst: short requests, kept queued until the second replica serves
# Sent after the burst, one per replica: still streaming when the low-load cooldown (2 s, which
# starts as the burst's last requests end) ends, on a quiet machine too (1.5-3 ms a token there;
# 1,200 tokens were done before a 4 s cooldown ended on a fast CI machine).
LONG_TOKENS = 1800
NUM_LONG = 2
BURST_QUEUE = 12  # requests kept in flight while the fleet grows: 8 queued past 4 slots > target 2


def _prompt(index: int) -> str:
    return f"Request {index}: tell me a long story about the sea."


def stream_completion(url: str, index: int, max_tokens: int) -> dict:
    """One streamed /v1/completions call: its text, tokens counted from usage, finish reason."""
    body = {"model": MODEL, "prompt": _prompt(index), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    text, finish, usage, num_chunks = "", None, None, 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            data = data_of(raw)
            if data is None or data == DONE:
                continue
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
            num_chunks += 1
    return {"id": chunk["id"].removeprefix("cmpl-"), "text": text, "finish_reason": finish, "usage": usage}


class FleetWatch:
    """Polls Redis: how many heartbeats, which replicas drain, tf:replicas:{model}, over time."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            live = registry.read_live(self.client, KEYS, [registry.SCHEDULERS])[registry.SCHEDULERS]
            beats = {name: fields.get(b"draining") for name, fields in live.items()}
            replicas = {k.decode(): v.decode() for k, v in self.client.hgetall(KEYS.replicas(MODEL)).items()}
            self.samples.append({"at": time.time(), "schedulers": sorted(beats),
                                 "draining": sorted(s for s, d in beats.items() if d == b"1"),
                                 "replicas": replicas})

    def wait_for(self, predicate, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.samples and predicate(self.samples[-1]):
                return self.samples[-1]
            time.sleep(0.1)
        raise AssertionError(f"not seen within {timeout_s} s: {what}; last: {self.samples[-1:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _single_replica_texts(model: Path, requests: list[tuple[int, int]]) -> dict[int, str]:
    with LLMEngine(EngineConfig(model=str(model), dtype="float32", num_kv_blocks=1024)) as engine:
        prompts = [engine.encode(_prompt(i)) for i, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        return {i: r.text for (i, _), r in zip(requests, engine.generate(prompts, params), strict=True)}


def test_burst_adds_a_replica_and_low_load_drains_it_without_cutting_a_stream(tiny_chat, tmp_path):
    port, redis_port = free_port(), free_port()
    up = UpProcess(
        ["--port", str(port), "--redis-port", str(redis_port), "--model", str(tiny_chat),
         "--model-name", MODEL, "--dtype", "float32", "--num-kv-blocks", "1024", "--max-num-seqs", "4",
         "--gateway-workers", "1",
         "--min-replicas", "1", "--max-replicas", "2", "--target-queue", "2", "--target-wait-s", "2",
         "--scale-up-cooldown-s", "1", "--scale-down-cooldown-s", "2", "--scale-down-load", "1.0",
         "--autoscale-interval-s", "0.5"],
        tmp_path / "home", TOKENFLEET_LOG_LEVEL="INFO")
    url = f"http://127.0.0.1:{port}"
    watch = None
    try:
        up.wait_up()
        assert "1-2 replicas, autoscaled" in up.output
        watch = FleetWatch(f"redis://127.0.0.1:{redis_port}/0")
        watch.wait_for(lambda s: s["replicas"].get("actual") == "1" and len(s["schedulers"]) == 1, 30,
                       "one replica at rest")
        with ThreadPoolExecutor(64) as pool:
            requests: dict[int, tuple[int, object]] = {}  # index -> (max_tokens, future)

            def send(max_tokens: int) -> None:
                index = len(requests)
                requests[index] = (max_tokens, pool.submit(stream_completion, url, index, max_tokens))

            # The burst lasts until a second scheduler serves, however long it takes to start here.
            while len(watch.samples[-1]["schedulers"]) < 2:
                if sum(1 for _, f in requests.values() if not f.done()) < BURST_QUEUE:
                    send(SHORT_TOKENS)
                else:
                    time.sleep(0.05)
                assert len(requests) < 2000, "no second scheduler"
            grown = watch.samples[-1]
            for _ in range(BURST_QUEUE):  # a last wave, for both
                send(SHORT_TOKENS)
            for _, future in list(requests.values()):
                future.result()
            for _ in range(NUM_LONG):  # one at a time: each goes to a scheduler still waiting for work
                send(LONG_TOKENS)
                time.sleep(0.3)
            shrinking = watch.wait_for(lambda s: s["replicas"].get("desired") == "1", 600, "a scale-down")
            results = {i: f.result() for i, (_, f) in requests.items()}
        shrunk = watch.wait_for(lambda s: len(s["schedulers"]) == 1 and s["replicas"].get("actual") == "1",
                                120, "back to one replica")
        client = redis.Redis.from_url(f"redis://127.0.0.1:{redis_port}/0")
        records = {i: client.hgetall(KEYS.result(r["id"])) for i, r in results.items()}
        # The controller logs the drained replica once it has reaped its process, which may come a
        # tick after the replica's heartbeat is gone.
        up.wait_for_output("replica_drained", 60)
    finally:
        if watch is not None:
            watch.close()
        assert up.stop() == 0, up.output[-3000:]
    # the second scheduler took work from the burst
    owners = {rec[b"scheduler"].decode() for rec in records.values()}
    assert len(owners) == 2 and len(grown["schedulers"]) == 2, owners
    # the fleet scaled down in the middle of streaming requests (the drained scheduler finishing
    # its own is pinned down in tests/scheduler/test_service_drain.py)
    assert len(set(grown["schedulers"]) - set(shrunk["schedulers"])) == 1
    assert any(float(rec[b"started_at"]) < shrinking["at"] < float(rec[b"finished_at"])
               for rec in records.values())
    # every request completed once, with all its tokens, the greedy text a single replica makes
    want = _single_replica_texts(tiny_chat, [(i, n) for i, (n, _) in requests.items()])
    for index, result in results.items():
        max_tokens = requests[index][0]
        assert result["finish_reason"] == "length"
        assert result["usage"]["completion_tokens"] == max_tokens
        assert result["text"] == want[index], index
        assert records[index][b"state"] == b"completed"
    assert "scale_up" in up.output and "scale_down" in up.output  # the scale events are in up's log


def test_autoscaled_tp2_replica_runs_in_the_placement_group_it_reserved_and_sigterm_leaves_nothing(
        tiny_chat, tmp_path):
    """With Ray groups, `up` reserves each replica's placement group itself (by name), the
    scheduler's ranks run in it, and a SIGTERM (which ray.init would turn into an abort in
    the driver) stops the fleet cleanly."""
    import psutil

    port, redis_port = free_port(), free_port()
    up = UpProcess(
        ["--port", str(port), "--redis-port", str(redis_port), "--model", str(tiny_chat),
         "--model-name", MODEL, "--dtype", "float32", "--num-kv-blocks", "64", "--gateway-workers", "1",
         "--tp", "2",
         "--min-replicas", "1", "--max-replicas", "2"],
        tmp_path / "home", TOKENFLEET_LOG_LEVEL="INFO")
    descendants: list[psutil.Process] = []
    try:
        up.wait_up()
        body = {"model": MODEL, "prompt": _prompt(0), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 8
        client = redis.Redis.from_url(f"redis://127.0.0.1:{redis_port}/0")
        deadline = time.monotonic() + 30  # the controller publishes what it sees at its next tick
        replicas = client.hgetall(KEYS.replicas(MODEL))
        while ((replicas.get(b"desired"), replicas.get(b"actual")) != (b"1", b"1")
               and time.monotonic() < deadline):
            time.sleep(0.2)
            replicas = client.hgetall(KEYS.replicas(MODEL))
        assert (replicas[b"desired"], replicas[b"actual"]) == (b"1", b"1")
        descendants = up.descendants()
        ranks = [p for p in descendants if "RankWorker" in " ".join(p.cmdline())]
        assert len(ranks) == 2
    finally:
        code = up.stop()
    assert code == 0, up.output[-3000:]
    assert '"placement_group": "tokenfleet-replica-tiny-r0"' in up.output
    time.sleep(1)
    alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [p.cmdline() for p in alive]
