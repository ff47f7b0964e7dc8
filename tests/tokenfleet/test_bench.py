"""`tokenfleet bench` against a real gateway (and the fake scheduler behind it), as a user runs it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio
REPO = Path(__file__).resolve().parents[2]


async def bench(*flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tokenfleet.cli", "bench", *flags]
    return await asyncio.to_thread(subprocess.run, argv, cwd=REPO, capture_output=True, text=True,
                                   timeout=120)


async def test_bench_streams_every_request_and_reports_latencies(make_client, fake_scheduler):
    client = await make_client()
    url = str(client.make_url("")).rstrip("/")
    done = await bench("--url", url, "--num-requests", "12", "--concurrency", "4", "--max-tokens", "8",
                       "--rate", "50", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["model"] == MODEL  # found through /v1/models
    assert (summary["ok"], summary["failed"], summary["errors"]) == (12, 0, {})
    assert summary["output_tokens"] == 12 * 8
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert summary[name]["p50"] is not None and summary[name]["p50"] >= 0, summary
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert len(fake_scheduler.seen) == 12
    assert all(m.sampling_params().max_tokens == 8 and m.sampling_params().ignore_eos
               for m in fake_scheduler.seen)
    table = await bench("--url", url, "--num-requests", "2", "--completions")
    assert table.returncode == 0 and "| TTFT |" in table.stdout and "2/2 requests" in table.stdout


async def test_bench_reports_failures_and_exits_non_zero(make_client, fake_scheduler):
    client = await make_client()
    url = str(client.make_url("")).rstrip("/")
    done = await bench("--url", url, "--num-requests", "3", "--model", "no-such-model", "--json")
    assert done.returncode == 1
    summary = json.loads(done.stdout)
    assert summary["failed"] == 3
    [(error, count)] = summary["errors"].items()
    assert count == 3 and "HTTP 404" in error and "no-such-model" in error


async def test_bench_sends_a_shared_prefix_drawn_lengths_for_a_duration_and_reports_goodput(
        make_client, fake_scheduler):
    client = await make_client()
    url = str(client.make_url("")).rstrip("/")
    done = await bench("--url", url, "--duration", "1", "--rate", "20", "--prefix-tokens", "40",
                       "--prompt-words", "5-12", "--max-tokens", "4-9:lognormal:6", "--concurrency", "64",
                       "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert 5 <= summary["num_requests"] <= 60 and summary["failed"] == 0  # Poisson at 20/s for 1 s
    assert summary["goodput"]["requests"] == summary["ok"]  # bounds no request can miss
    assert summary["tpot_ms"]["p50"] is not None
    seen = fake_scheduler.seen
    assert len(seen) == summary["num_requests"]
    assert {4 <= m.sampling_params().max_tokens <= 9 for m in seen} == {True}
    prompts = [list(m.prompt_token_ids) for m in seen]
    shared = min(len(p) for p in prompts)
    while len({tuple(p[:shared]) for p in prompts}) > 1:
        shared -= 1
    assert shared >= 40  # the system prompt (and the chat template around it) is the same
    tight = await bench("--url", url, "--num-requests", "3", "--max-tokens", "8", "--slo-ttft-ms", "0",
                        "--json")
    assert json.loads(tight.stdout)["goodput"]["requests"] == 0


async def test_the_plan_is_the_same_for_the_same_flags_and_lengths_stay_in_their_bounds() -> None:
    import argparse
    import random

    from tokenfleet.bench import LengthSpec, plan_requests

    args = argparse.Namespace(seed=3, prompt_words="2-4", max_tokens="16-512:lognormal:150", prefix_tokens=10,
                              num_requests=50, duration=0.0, rate=8.0, temperature=0.0, completions=False)
    first, again = plan_requests(args, "m"), plan_requests(args, "m")
    assert [(p.arrival, p.body) for p in first] == [(p.arrival, p.body) for p in again]
    assert len(first) == 50 and first[0].arrival == 0.0
    assert all(16 <= p.body["max_tokens"] <= 512 for p in first)
    assert len({p.body["messages"][0]["content"] for p in first}) == 1  # one system prompt
    spec = LengthSpec.parse("16-512:lognormal:150", "max-tokens")
    draws = [spec.draw(random.Random(i)) for i in range(2000)]
    assert 120 < sum(draws) / len(draws) < 180
    for bad in ("0", "9-3", "x", "4-8:normal:5", "4-8:lognormal:-1"):
        with pytest.raises(ValueError, match="--max-tokens"):
            LengthSpec.parse(bad, "max-tokens")


async def test_a_json_share_asks_a_schema_of_that_share_of_the_same_chats() -> None:
    import argparse

    from tokenfleet.bench import BENCH_RESPONSE_FORMAT, plan_requests

    args = argparse.Namespace(seed=4, prompt_words="2-4", max_tokens="8", prefix_tokens=0, num_requests=400,
                              duration=0.0, rate=8.0, temperature=0.0, completions=False)
    plain = plan_requests(args, "m")
    args.json_share = 0.1
    mixed = plan_requests(args, "m")
    is_json = [p.body.pop("response_format", None) == BENCH_RESPONSE_FORMAT for p in mixed]
    assert 20 <= sum(is_json) <= 60  # about 40
    assert [(p.arrival, p.body) for p in mixed] == [(p.arrival, p.body) for p in plain]  # else the same


async def test_bench_refuses_a_json_share_outside_zero_to_one():
    done = await bench("--url", "http://127.0.0.1:1", "--json-share", "1.5")
    assert done.returncode != 0 and "--json-share" in done.stderr and "Traceback" not in done.stderr


async def test_bench_refuses_a_bad_length_in_one_line():
    done = await bench("--url", "http://127.0.0.1:1", "--max-tokens", "10-5")
    assert done.returncode != 0 and "--max-tokens" in done.stderr and "Traceback" not in done.stderr


async def test_bench_deals_its_requests_over_client_processes(make_client, fake_scheduler):
    client = await make_client()
    url = str(client.make_url("")).rstrip("/")
    done = await bench("--url", url, "--num-requests", "9", "--client-processes", "3", "--max-tokens", "4",
                       "--rate", "30", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["ok"], summary["failed"], summary["output_tokens"]) == (9, 0, 9 * 4)
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert len(fake_scheduler.seen) == 9


async def test_multi_turn_conversations_resend_their_history(make_client, fake_scheduler):
    client = await make_client()
    url = str(client.make_url("")).rstrip("/")
    done = await bench("--url", url, "--multi-turn", "--conversations", "3", "--turns", "3", "--rate", "20",
                       "--prefix-tokens", "20", "--prompt-words", "5", "--max-tokens", "4", "--think-seconds",
                       "0.05", "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["ok"], summary["conversations"], summary["turns"]) == (9, 3, 3)
    assert summary["think_seconds"] == 0.05
    assert sorted(summary["ttft_ms_by_turn"]) == ["0", "1", "2"]
    # Each turn carried the system prompt and every earlier user message and reply of its conversation.
    assert len(fake_scheduler.seen) == 9
    lengths = sorted(len(m.prompt_token_ids) for m in fake_scheduler.seen)
    assert lengths[-1] > 2 * lengths[0]
    refused = await bench("--url", url, "--multi-turn", "--turns", "0")
    assert refused.returncode != 0 and "--turns" in refused.stderr
    refused = await bench("--url", url, "--multi-turn", "--think-seconds", "-1")
    assert refused.returncode != 0 and "--think-seconds" in refused.stderr
    assert "Traceback" not in refused.stderr


async def test_multi_turn_think_times_are_drawn_per_turn_and_leave_the_rest_of_the_plan_alone():
    from tokenfleet.bench_multiturn import plan_conversations
    from tokenfleet.cli import build_parser

    def plan(*flags: str):
        args = build_parser().parse_args(["bench", "--multi-turn", "--conversations", "20", "--turns", "4",
                                          "--rate", "5", "--prompt-words", "5", *flags])
        return plan_conversations(args)

    system, without = plan()
    assert all(pause == 0.0 for c in without for pause in c.think_s)
    system_too, thinking = plan("--think-seconds", "3")
    assert plan("--think-seconds", "3") == (system_too, thinking)  # seeded
    assert system_too == system
    for quiet, thinks in zip(without, thinking, strict=True):
        # The same arrivals and messages: only the pauses differ.
        assert (thinks.arrival, thinks.user_messages, thinks.max_tokens) == (
            quiet.arrival, quiet.user_messages, quiet.max_tokens)
        assert thinks.think_s[0] == 0.0 and all(pause > 0 for pause in thinks.think_s[1:])
    pauses = [pause for c in thinking for pause in c.think_s[1:]]
    assert len(set(pauses)) == len(pauses)  # drawn (exponential), not one fixed gap
    assert 1.5 < sum(pauses) / len(pauses) < 6  # around the mean asked (60 draws)
