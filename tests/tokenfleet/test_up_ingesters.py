"""`tokenfleet up --batch-ingesters N`: each standalone ingester is told what the gateway's own
is (Fleet.batch_argv): the served model name and the tenants. Run here as `up` starts it, from
exactly the command line and environment Fleet.ingester_command gives, on a real Redis."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from protocol.keys import Keys
from tests.gateway.batch_fleet import wait_for_job
from tests.gateway.fake_scheduler import FakeScheduler
from tokenfleet.cli import build_parser, fleet_options, gateway_settings, ingester_settings
from tokenfleet.up import Fleet

KEYS = Keys()
NAME = "served-as-x"
REPO = Path(__file__).resolve().parents[2]


def _lines(num: int) -> str:
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}) for i in range(num))


def _fleet(smollm2, redis_url: str, tmp_path: Path, monkeypatch) -> Fleet:
    monkeypatch.setenv("TOKENFLEET_HOME", str(tmp_path))
    tenants = tmp_path / "tenants.json"
    team = {"keys": ["key-a"], "max_batch_lines_in_flight": 3}
    tenants.write_text(json.dumps({"tenants": {"team-a": team}}))
    up = build_parser().parse_args(["up", "--model", str(smollm2), "--model-name", NAME, "--tenants-file",
                                    str(tenants), "--batch-ingesters", "1"])
    fleet = Fleet(fleet_options(up))
    fleet.redis_url = redis_url  # (what starting its Redis would set)
    return fleet


def test_an_ingesters_settings_are_the_gateways_own(smollm2, redis_server, tmp_path, monkeypatch):
    fleet = _fleet(smollm2, redis_server.url, tmp_path, monkeypatch)
    ingester = ingester_settings(build_parser().parse_args(fleet.ingester_command()[0][3:]))
    gateway = gateway_settings(build_parser().parse_args(fleet.gateway_command()[0][3:]))
    for field in ("redis_url", "models", "key_prefix", "tenants_from_redis", "batch_max_inflight",
                  "batch_lease_s"):
        assert getattr(ingester, field) == getattr(gateway, field), field
    assert [m.name for m in ingester.models] == [NAME]
    assert ingester.tenants.get("team-a").limits.max_batch_lines_in_flight == 3


@pytest.mark.slow  # (a process of its own)
def test_a_standalone_ingester_serves_the_model_name_and_caps_a_tenants_lines(
        smollm2, redis_server, tokenizer, tmp_path, monkeypatch):
    fleet = _fleet(smollm2, redis_server.url, tmp_path, monkeypatch)
    argv, env = fleet.ingester_command()
    plain = redis_server.client()
    ingester = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with FakeScheduler(redis_server.url, NAME, tokenizer, kinds=("interactive", "batch")):
            plain.xadd(KEYS.batch_in, {"job_id": "job-x", "model": NAME, "lines": _lines(4)})
            job = wait_for_job(plain, "job-x", timeout_s=120)
            assert (job["status"], job["completed"], job["failed"]) == ("completed", "4", "0"), job
        # A tenant's job, with its scheduler alive and taking nothing: at most 3 lines queued.
        with FakeScheduler(redis_server.url, NAME, tokenizer, consume=False, scheduler_id="fake-2",
                           kinds=("interactive", "batch")):
            plain.xadd(KEYS.batch_in, {"job_id": "job-a", "model": NAME, "lines": _lines(10),
                                       "tenant": "team-a"})
            stream = KEYS.request_stream(NAME, "batch", "team-a")
            deadline = time.monotonic() + 120
            while plain.xlen(stream) < 3:
                assert ingester.poll() is None, ingester.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, plain.hgetall(KEYS.batch_job("job-a"))
                time.sleep(0.05)
            time.sleep(1.0)  # the feeder had its chances to queue more (it looks every 0.2 s)
            assert plain.xlen(stream) == 3
    finally:
        ingester.terminate()
        ingester.wait(timeout=60)
