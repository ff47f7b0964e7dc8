"""The mixed-traffic benchmark's checker finds a line written twice, a missing line and a wrong
status; its meter's rate is taken between the heartbeats seen inside a window; the step trace is
cut to a window and its mixed steps summarised."""

from __future__ import annotations

import json

from protocol.keys import Keys
from testkit.mixed_traffic import TokenMeter, check_job
from testkit.step_windows import (
    StepWindow,
    grammar_summary,
    in_window,
    is_level,
    is_mixed,
    mixed_summary,
    read_trace,
)


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


def test_token_meter_tokens_are_counted_between_the_heartbeats_inside_the_window() -> None:
    meter = TokenMeter("redis://127.0.0.1:1/0")
    meter.samples = [(0.0, 0), (1.0, 100), (2.0, 300), (3.0, 600)]
    assert meter.tokens(0.5, 2.5) == (200, 1.0, 2.0)
    assert meter.tokens(2.5, 2.9) == (0, 2.5, 2.5)  # no two heartbeats: nothing measured


def test_a_window_is_level_when_its_halves_agree_and_not_while_it_ramps() -> None:
    meter = TokenMeter("redis://127.0.0.1:1/0")
    # A ramp (100, 300, 500 tokens a second), then a level of 1,000 +- 5%.
    totals = [0, 100, 400, 900, 1900, 2850, 3900, 4900, 5850, 6900]
    meter.samples = [(float(t), n) for t, n in enumerate(totals)]
    assert meter.halves(0.0, 4.0) == (200.0, 750.0) and not is_level(*meter.halves(0.0, 4.0))
    assert meter.halves(3.0, 7.0) == (975.0, 1025.0) and is_level(*meter.halves(3.0, 7.0))
    assert is_level(*meter.halves(5.0, 9.0)) and not is_level(*meter.halves(5.0, 9.0), tolerance=0.01)
    draining = is_level(1000.0, 800.0)
    assert not draining and not is_level(0.0, 0.0)
    meter.samples = [(0.0, 0), (5.0, 500), (6.0, 1500), (7.0, 2500)]
    assert not is_level(*meter.halves(3.0, 7.0))  # the first half holds one heartbeat: nan


def test_step_windows_count_a_window_s_steps_and_summarise_its_mixed_steps(tmp_path) -> None:
    def step(t: float, chats: int, decodes: int, prefill: int, predicted: float, ms: float) -> dict:
        return {"t": t, "tokens": chats + decodes + prefill, "chat_rows": chats, "chat_tokens": chats,
                "batch_decode_rows": decodes, "batch_prefill_tokens": prefill, "kv_tokens": 100 * decodes,
                "predicted_ms": predicted, "ms": ms}

    trace = tmp_path / "steps.jsonl"
    steps = [step(1.0, 0, 8, 0, 5.0, 5.0), step(2.0, 2, 8, 0, 6.0, 9.0), step(3.0, 2, 8, 64, 10.0, 8.0),
             step(4.0, 2, 0, 0, 2.0, 2.0), step(9.0, 0, 8, 0, 5.0, 5.0)]
    trace.write_text("".join(json.dumps(s) + "\n" for s in steps) + '{"t": 9.5, "tok')  # a torn last line
    read = read_trace(trace)
    assert read == steps and read_trace(tmp_path / "missing.jsonl") == []
    window = StepWindow("mixed", 4.0, 400, in_window(read, 1.5, 5.0))
    assert len(window.steps) == 3 and window.step_tokens == 10 + 74 + 2 and window.tok_s == 100.0
    assert "3 steps of 86 tokens" in window.line()
    assert [is_mixed(s) for s in window.steps] == [True, True, False]
    summary = mixed_summary(window.steps)
    assert "| mixed steps | 2 |" in summary and "| chats only | 1 |" in summary
    assert "| mixed, batch decodes only | 1 |" in summary and "| mixed, with batch prefill | 1 |" in summary
    assert "over their prediction: 1 of 2" in summary


def test_the_grammar_summary_sets_steps_with_constrained_rows_against_the_others() -> None:
    steps = [{"t": 1.0, "rows": 8, "tokens": 8, "ms": 10.0, "constrained_rows": 2, "samples_late": True,
              "fill_ms": 0.5, "late_wait_ms": 9.0},
             {"t": 2.0, "rows": 8, "tokens": 8, "ms": 8.0, "constrained_rows": 0, "samples_late": False,
              "fill_ms": 0.0, "late_wait_ms": None},
             {"t": 3.0, "rows": 8, "tokens": 8, "ms": 12.0, "constrained_rows": 1, "samples_late": True,
              "fill_ms": 0.7, "late_wait_ms": 11.0}]
    summary = grammar_summary(steps)
    assert "| with constrained rows, sampled late | 2 | 8 | 2 | 8 | - | 11.0 | 0.6 | 10.0 |" in summary
    assert "| without | 1 |" in summary and "sampled at launch" not in summary
