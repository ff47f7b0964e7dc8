"""Engine metrics and the throughput log, on the in-process engine with a tiny checkpoint."""

from __future__ import annotations

import json
import random
import time

from structlog.testing import capture_logs

from scheduler.engine import LLMEngine
from scheduler.engine_metrics import EngineMetrics
from scheduler.throughput import ThroughputLog
from shared.config import EngineConfig
from shared.sampling import SamplingParams

LABELS = {"model_name": "tiny", "scheduler": "s0"}


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=512, max_num_seqs=8,
                  max_num_batched_tokens=64)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def _value(metrics: EngineMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(f"tokenfleet:{name}", {**LABELS, **labels})
    assert value is not None, name
    return value


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(5, 40))] for _ in range(n)]


def test_counters_match_what_generate_returned_and_gauges_end_at_zero(tiny_checkpoints):
    prompts = _prompts(5)
    sampling = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 9, 17, 1, 12)]
    with _engine(tiny_checkpoints["qwen2"]) as engine:
        metrics = EngineMetrics(engine.scheduler, "tiny", "s0")
        engine.step_observer = metrics
        results = engine.generate(prompts, sampling)
        num_steps = engine.num_steps
    num_prompt = sum(len(p) for p in prompts)
    num_generated = sum(len(r.token_ids) for r in results)
    assert num_generated == 3 + 9 + 17 + 1 + 12
    assert _value(metrics, "prompt_tokens_total") == num_prompt
    assert _value(metrics, "generation_tokens_total") == num_generated
    assert _value(metrics, "request_success_total", finished_reason="length") == 5
    assert _value(metrics, "request_success_total", finished_reason="stop") == 0
    assert _value(metrics, "num_preemptions_total") == 0
    # Every prompt token is computed once, every output token but the last is fed back once.
    assert _value(metrics, "iteration_tokens_total_sum") == num_prompt + num_generated - len(prompts)
    assert _value(metrics, "iteration_tokens_total_count") == num_steps
    assert _value(metrics, "step_duration_seconds_count") == num_steps
    assert _value(metrics, "step_duration_seconds_sum") > 0
    # The wait for results is part of the steps' time (each step waits once, inside its duration).
    waited = _value(metrics, "engine_result_wait_seconds_total")
    assert 0 < waited <= _value(metrics, "step_duration_seconds_sum")
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _value(metrics, gauge) == 0
    # Prefix caching exists or not: the counters are there either way.
    assert _value(metrics, "prefix_cache_queries_total") >= _value(metrics, "prefix_cache_hits_total") >= 0
    # The per-second history the status page draws holds every generated token.
    assert sum(n for _, n in metrics.generation_history.recent(time.time())) == num_generated
    text = metrics.exposition().decode()
    assert 'tokenfleet:kv_cache_usage_perc{model_name="tiny",scheduler="s0"} 0.0' in text


def test_preemptions_are_counted_and_a_recomputed_prompt_is_not_counted_twice(tiny_checkpoints):
    prompts = _prompts(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    # 30 blocks of 4 tokens: three sequences of up to 100 tokens cannot all stay.
    with _engine(tiny_checkpoints["qwen2"], num_kv_blocks=30) as engine:
        metrics = EngineMetrics(engine.scheduler, "tiny", "s0")
        engine.step_observer = metrics
        ids = [engine.add_request(p, greedy) for p in prompts]
        requests = [engine.scheduler.get_request(i) for i in ids]
        peak_kv = 0.0
        while engine.has_unfinished_requests():
            engine.step()
            peak_kv = max(peak_kv, _value(metrics, "kv_cache_usage_perc"))
    num_preemptions = sum(r.num_preemptions for r in requests)
    assert num_preemptions > 0
    assert _value(metrics, "num_preemptions_total") == num_preemptions
    assert _value(metrics, "prompt_tokens_total") == sum(len(p) for p in prompts)
    assert _value(metrics, "generation_tokens_total") == 3 * 60
    assert peak_kv > 0.5 and _value(metrics, "kv_cache_usage_perc") == 0


def test_throughput_log_writes_a_line_per_busy_window_and_stays_silent_when_idle(tiny_checkpoints):
    with _engine(tiny_checkpoints["llama"]) as engine:
        metrics = EngineMetrics(engine.scheduler, "tiny", "s0")
        engine.step_observer = metrics
        with capture_logs() as logs:
            log = ThroughputLog(metrics, interval_s=5.0)
            now = log._next
            assert not log.maybe_log(now)  # idle window: silent
            engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=4, ignore_eos=True))
            engine.step()
            engine.step()
            assert not log.maybe_log(now + 1)  # the window is not over
            assert log.maybe_log(now + 5)  # busy window: a line
            while engine.has_unfinished_requests():
                engine.step()
            assert log.maybe_log(now + 10)  # the window in which the work ended
            assert not log.maybe_log(now + 15)  # idle again: silent
    lines = [entry for entry in logs if entry["event"] == "engine_throughput"]
    assert len(lines) == 2
    first, last = lines
    assert first["prompt_tokens_per_s"] == 20 / 5 and first["generation_tokens_per_s"] == 2 / 5
    assert first["num_running"] == 1 and first["num_waiting"] == 0 and first["kv_cache_usage_pct"] > 0
    assert last["generation_tokens_per_s"] == 2 / 5 and last["num_running"] == 0
    assert last["kv_cache_usage_pct"] == 0


def test_the_step_trace_has_a_line_per_step_whose_tokens_add_up(tiny_checkpoints, tmp_path, monkeypatch):
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("TOKENFLEET_STEP_TRACE", str(trace))
    prompts = _prompts(3)
    sampling = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 7, 2)]
    with _engine(tiny_checkpoints["qwen2"]) as engine:
        engine.generate(prompts, sampling)
        num_steps = engine.num_steps
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == num_steps
    assert [line["step"] for line in lines] == sorted(line["step"] for line in lines)
    # Every prompt token is computed once, every output token but the last is fed back once.
    assert sum(line["tokens"] for line in lines) == sum(map(len, prompts)) + 4 + 7 + 2 - 3
    assert all(line["ms"] > 0 and line["rows"] >= 1 for line in lines)
    # Its parts add up to its tokens (interactive requests here: no batch rows), and each step after
    # the first was predicted by the cost model the steps before it taught.
    assert all(line["chat_tokens"] == line["tokens"] and line["chat_rows"] == line["rows"] for line in lines)
    assert all(line["predicted_ms"] > 0 for line in lines[1:])
