"""Worker groups on a real local Ray: failure recovery and replicas."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import ray

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


def generate_killing_a_rank(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                            victim_rank: int, steps_before: int) -> list[list[int]]:
    """Every prompt's tokens, with one rank killed (kill -9) mid-generation, after `steps_before`
    engine steps; exactly one rebuild of the group is expected."""
    ids = [engine.add_request(p, params, req_id=f"killed-{i}") for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(steps_before):
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
    assert any(tokens.values()) and not all(len(t) == params.max_tokens for t in tokens.values())
    os.kill(engine.executor.rank_pids()[victim_rank], signal.SIGKILL)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
    assert engine.num_group_restarts == 1
    return [tokens[i] for i in ids]


@pytest.mark.parametrize("victim_rank", [0, 1])
def test_killed_rank_is_rebuilt_and_every_request_completes_identically(victim_rank, tiny_checkpoints):
    folder = tiny_checkpoints["qwen2"]
    prompts = _prompts(6)
    with LLMEngine(_config(folder, tp=2)) as engine:
        undisturbed = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    with LLMEngine(_config(folder, tp=2)) as engine:  # mid-generation: prefills done, some tokens out
        assert generate_killing_a_rank(engine, prompts, GREEDY, victim_rank, steps_before=8) == undisturbed


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


def _cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _wait_until_parked(group, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not group.is_parked:
        assert time.monotonic() < deadline, "the idle group never parked its ranks"
        time.sleep(0.02)


def test_an_idle_group_parks_its_ranks_and_the_next_step_wakes_them(tiny_checkpoints):
    """Idle ranks block instead of spinning in the compiled graph's channel read, and the
    next request runs as if they never slept: woken by datagram on this host, or by an actor
    call for a rank whose socket is out of reach (a rank on another host)."""
    folder = tiny_checkpoints["llama"]
    prompts = _prompts(4)
    with LLMEngine(_config(folder, tp=2)) as engine:
        group = engine.executor
        first = [r.token_ids for r in engine.generate(prompts, GREEDY)]
        _wait_until_parked(group)
        pids = group.rank_pids()
        before = [_cpu_seconds(pid) for pid in pids]
        start = time.monotonic()
        time.sleep(1.5)
        elapsed = time.monotonic() - start
        shares = [(_cpu_seconds(pid) - cpu) / elapsed for pid, cpu in zip(pids, before, strict=True)]
        assert max(shares) < 0.05, shares
        assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == first
        _wait_until_parked(group)
        group.infos[1].wake_address = b"\0tokenfleet-wake-on-another-host"
        assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == first
        assert engine.num_group_restarts == 0


def test_a_stopping_group_takes_every_rank_out_of_its_process_group_before_killing_it(
        tiny_checkpoints, monkeypatch):
    """No rank is killed while still in the torch.distributed group (whose TCPStore server is
    rank 0: a rank killed early leaves the others' NCCL watchdogs writing "Broken pipe"
    traces), and the ranks' own logs hold no error trace after a normal stop."""
    folder = tiny_checkpoints["qwen2"]
    in_group_when_killed: list[bool] = []
    kill = ray.kill

    def in_process_group(worker) -> bool:
        import torch.distributed

        return torch.distributed.is_initialized()

    def recording_kill(actor, *args, **kwargs) -> None:
        try:
            in_group_when_killed.append(ray.get(actor.__ray_call__.remote(in_process_group), timeout=30))
        except ray.exceptions.RayActorError:
            pass  # killed already
        kill(actor, *args, **kwargs)

    with LLMEngine(_config(folder, tp=2)) as engine:
        engine.generate(_prompts(2), GREEDY)
        pids = engine.executor.rank_pids()
        monkeypatch.setattr(ray, "kill", recording_kill)
    assert in_group_when_killed and not any(in_group_when_killed), in_group_when_killed
    logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
    for pid in pids:
        [err] = logs_dir.glob(f"worker-*-{pid}.err")
        text = err.read_text()
        assert not re.search(r"Traceback|Broken pipe|\[error|ERROR", text), text[-3000:]


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
    common = [sys.executable, "-m", "tokenfleet.cli", "generate", "--model", str(smollm2), "--json",
              "--max-tokens", "16", "--dtype", "float32", "--num-kv-blocks", "64",
              "The capital of France is", "1, 2, 3,"]
    # The reference, TP=1 in its own process, runs while the head starts.
    local = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        on_cluster = subprocess.run([*common, "--tp", "2", "--ray-address", address],
                                    capture_output=True, text=True, timeout=300, env=env)
        local_stdout, local_stderr = local.communicate(timeout=300)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        if local.poll() is None:
            local.kill()
            local.wait()
    assert on_cluster.returncode == 0, on_cluster.stderr[-2000:]
    assert local.returncode == 0, local_stderr[-2000:]
    assert on_cluster.stdout == local_stdout
