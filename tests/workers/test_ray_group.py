"""Worker groups on a real local Ray: failure recovery and replicas."""

from __future__ import annotations

import os
import random
import signal

import pytest

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _config(folder, **overrides) -> EngineConfig:
    base = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256,
                max_num_seqs=8, max_num_batched_tokens=32)
    return EngineConfig(**{**base, **overrides})


@pytest.mark.parametrize("victim_rank", [0, 1])
def test_killed_rank_is_rebuilt_and_every_request_completes_identically(victim_rank, tiny_checkpoints):
    folder = tiny_checkpoints["qwen2"]
    prompts = _prompts(6)
    with LLMEngine(_config(folder, tp=2)) as engine:
        undisturbed = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    with LLMEngine(_config(folder, tp=2)) as engine:
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        for _ in range(8):  # mid-generation: prefills done, some tokens out
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        assert any(tokens.values()) and not all(len(t) == 24 for t in tokens.values())
        os.kill(engine.executor.rank_pids()[victim_rank], signal.SIGKILL)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
        assert engine.num_group_restarts == 1
    assert [tokens[i] for i in ids] == undisturbed


def test_two_replicas_both_serve_and_match_one_engine(tiny_checkpoints):
    from scheduler.replicas import ReplicatedEngine

    folder = tiny_checkpoints["llama"]
    prompts = _prompts(8)
    with LLMEngine(_config(folder)) as engine:
        expected = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    with ReplicatedEngine(_config(folder), num_replicas=2) as replicas:
        results = replicas.generate(prompts, GREEDY)
        pids = [engine.executor.rank_pids()[0] for engine in replicas.engines]
        assert all(n > 0 for n in replicas.num_requests_per_replica), replicas.num_requests_per_replica
        assert all(engine.num_steps > 0 for engine in replicas.engines)
    assert len(set(pids)) == 2  # two worker processes
    assert [r.token_ids for r in results] == expected


def test_tp2_on_an_existing_cluster_started_with_ray_start(smollm2, tmp_path):
    """A real `ray start --head`; the CLI joins it with --ray-address (in its own process,
    since this test process already runs a local Ray)."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"127.0.0.1:{port}"
    # Token authentication, as a real deployment should run it; the head and every
    # client share the token through the environment.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
         "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats",
         "--node-ip-address=127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # until the head answers `ray status`
            status = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status",
                                     f"--address={address}"], capture_output=True, timeout=60, env=env)
            if status.returncode == 0:
                break
            time.sleep(1)
        common = [sys.executable, "-m", "tokenfleet.cli", "generate", "--model", str(smollm2), "--json",
                  "--max-tokens", "16", "--dtype", "float32", "--num-kv-blocks", "64",
                  "The capital of France is", "1, 2, 3,"]
        on_cluster = subprocess.run([*common, "--tp", "2", "--ray-address", address],
                                    capture_output=True, text=True, timeout=300, env=env)
        local = subprocess.run(common, capture_output=True, text=True, timeout=300)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
    assert on_cluster.returncode == 0, on_cluster.stderr[-2000:]
    assert on_cluster.stdout == local.stdout
