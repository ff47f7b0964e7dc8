"""`tokenfleet up`: the whole fleet from one command, answering, then gone after SIGTERM."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from shared.net import free_port
from tests.fleet_helpers import UpProcess

pytestmark = pytest.mark.slow


def _processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if text in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
    return alive


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _busy_while_idle(up: UpProcess) -> dict[str, str]:
    """Rank workers and schedulers of a fleet with no traffic that used 5% of a core or more
    over 3 s. A rank waiting for its next step in Ray's compiled-graph channel read spins a
    full core unless the group parks it (workers/ray_group.py)."""
    time.sleep(1.0)  # past the group's parking delay (50 ms) and the start-up's tail
    names = {p: " ".join(p.cmdline()).strip() for p in up.descendants()}
    ranks = [p for p, name in names.items() if "RankWorker" in name]
    schedulers = [p for p, name in names.items() if " scheduler " in name]
    # Count on the whole command line: the labels below are cut short, and a long checkout
    # path (CI's is) would cut " scheduler " off them.
    assert len(ranks) == 2, list(names.values())
    assert len(schedulers) == 1, list(names.values())
    watched = {p: f"{names[p][-60:]} (pid {p.pid})" for p in ranks + schedulers}
    before = {p: _cpu_seconds(p) for p in watched}
    start = time.monotonic()
    time.sleep(3.0)
    elapsed = time.monotonic() - start
    shares = {watched[p]: (_cpu_seconds(p) - before[p]) / elapsed for p in watched}
    return {name: f"{share:.0%} of a core" for name, share in shares.items() if share >= 0.05}


# (TP=2 through `tokenfleet scheduler --tp 2` is served in tests/workers/test_ray_group.py and
# tests/test_fleet_autoscale.py; here a two-rank Ray group is the pipeline's.)
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (1, 2)])
def test_up_serves_a_chat_completion_and_leaves_nothing_after_sigterm(smollm2, tmp_path, tp, pp):
    """TP=1, then a Ray group of two pipeline stages on this CPU (SmolLM2's 30 layers as
    15 + 15, its tied embedding the last stage's LM head). At TP=1 a batch job also goes
    through, from the CLI with no flags (it finds the fleet's Redis in fleet.json). With the Ray
    group (where a parked rank matters), the idle fleet first leaves its cores idle."""
    port = free_port()
    home = tmp_path / "home"
    up = UpProcess(["--port", str(port), "--model", str(smollm2), "--num-kv-blocks", "256",
                    "--dtype", "float32", "--tp", str(tp), "--pp", str(pp)], home)
    descendants: list[psutil.Process] = []
    try:
        up.wait_up()
        up.wait_for_output(f"http://127.0.0.1:{port}/v1/chat/completions", 30)  # the curl it prints
        fleet = json.loads((home / "fleet.json").read_text())
        assert fleet["gateway_url"] == f"http://127.0.0.1:{port}"
        descendants = up.descendants()
        # redis, scheduler, gateway (and their children); Ray only for a group of several ranks
        assert len(descendants) >= (3 if tp * pp == 1 else 4)
        if tp * pp == 2:
            busy = _busy_while_idle(up)
            assert not busy, busy
        body = json.dumps({"model": smollm2.name, "max_tokens": 16, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert "Paris" in answer["choices"][0]["message"]["content"]
        if tp * pp > 1:
            ranks = [p for p in up.descendants() if "RankWorker" in " ".join(p.cmdline())]
            assert len(ranks) == tp * pp, [p.cmdline() for p in ranks]
        else:
            job = tmp_path / "job.jsonl"
            job.write_text(json.dumps({"custom_id": "paris", "method": "POST", "url": "/v1/chat/completions",
                                       "body": json.loads(body)}) + "\n")
            done = subprocess.run([sys.executable, "-m", "tokenfleet.cli", "batch", "submit", str(job),
                                   "--wait", "--output", str(tmp_path / "out.jsonl")],
                                  env=up.env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            [line] = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
            assert line["custom_id"] == "paris"
            assert "Paris" in line["response"]["body"]["choices"][0]["message"]["content"]
    finally:
        descendants = up.descendants() or descendants  # Ray's workers too, by now
        assert up.stop() == 0, up.output[-3000:]
    # What up signalled exits on its own time (Ray's processes notice their parent gone): wait
    # for it, as long as a loaded machine may need; one that is left stays past any deadline.
    deadline = time.monotonic() + 60
    while (alive := _alive(descendants)) or _processes_mentioning(str(home)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not alive, [p.cmdline() for p in alive]
    assert not _processes_mentioning(str(home))
    assert not (home / "fleet.json").exists()
