"""The mixed-traffic benchmark's checker finds a line written twice, a missing line and a wrong
status; its meter's rate is taken between the heartbeats seen inside a window."""

from __future__ import annotations

import json

from protocol.keys import Keys
from testkit.mixed_traffic import TokenMeter, check_job


def write_job(client, job_id: str, indices: list[int], *, status: str,
              failed_code: str | None = None) -> None:
    for index in indices:
        ok = failed_code is None
        line = ({"response": {"body": {"usage": {"completion_tokens": 8}}}} if ok
                else {"error": {"code": failed_code}})
        client.xadd(Keys().batch_out(job_id), {"index": index, "custom_id": f"line-{index}", "ok": int(ok),
                                               "line": json.dumps(line)})
    num_failed = 0 if failed_code is None else len(indices)
    client.hset(Keys().batch_job(job_id), mapping={"status": status, "completed": len(indices) - num_failed,
                                                   "failed": num_failed})


def test_check_job_passes_every_line_once_and_names_what_is_wrong(redis_server) -> None:
    client = redis_server.client()
    write_job(client, "good", list(range(5)), status="completed")
    assert check_job(client, "good", 5, max_tokens=8).passed
    write_job(client, "twice", [0, 1, 1, 2], status="completed")
    problems = check_job(client, "twice", 3, max_tokens=8).problems
    assert "line-1 written twice" in problems and any("4 outputs for 3 lines" in p for p in problems)
    write_job(client, "short", [0, 1], status="completed")
    assert any("1 missing" in p for p in check_job(client, "short", 3).problems)
    assert check_job(client, "good", 5, max_tokens=9).problems[0] == "line-0: 8 tokens, not 9"
    write_job(client, "stopped", [0, 1, 2], status="cancelled", failed_code="batch_cancelled")
    assert check_job(client, "stopped", 3, cancelled=True).passed
    assert "status cancelled, expected completed" in check_job(client, "stopped", 3).problems


def test_token_meter_rate_is_taken_between_the_heartbeats_inside_the_window() -> None:
    meter = TokenMeter("redis://127.0.0.1:1/0")  # (never started: no Redis needed)
    meter.samples = [(0.0, 0), (1.0, 100), (2.0, 300), (3.0, 600), (4.0, 1000)]
    assert meter.rate(0.5, 3.5) == 250.0  # from 1.0 s to 3.0 s: 500 tokens
    assert meter.rate(3.5, 3.9) != meter.rate(3.5, 3.9)  # fewer than two heartbeats: nan
