"""Chats beside a batch job on a running fleet (scripts/bench_mixed_gpu.py): batch jobs written to
tf:batch:in by a plain Redis client, the fleet's generated tokens metered from its schedulers'
heartbeats, every job's output lines checked exactly once, and the table of the chats' latency
alone and beside the batch."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import redis

from protocol import registry
from protocol.keys import Keys
from testkit.runs import percentile
from tokenfleet.bench import prompt_text

JOB_END_STATUSES = ("completed", "failed", "cancelled", "expired")


def batch_lines(num_lines: int, model: str, *, words: tuple[int, int], max_tokens: int,
                seed: int) -> list[str]:
    """Chat lines in the OpenAI Batch input format: one user turn of `words` words (about a
    token each), `max_tokens` greedy output tokens, EOS ignored (every line costs the same)."""
    rng = random.Random(f"batch-{seed}")
    lines = []
    for i in range(num_lines):
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "user", "content": prompt_text(rng, rng.randint(*words))}]}
        lines.append(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return lines


def submit_job(client: redis.Redis, job_id: str, lines: list[str]) -> None:
    """As any producer does: one entry on tf:batch:in (the gateway's ingester takes it)."""
    client.xadd(Keys().batch_in, {"job_id": job_id, "lines": "\n".join(lines) + "\n"})


def job_status(client: redis.Redis, job_id: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in client.hgetall(Keys().batch_job(job_id)).items()}


def num_written(client: redis.Redis, job_id: str) -> int:
    return client.xlen(Keys().batch_out(job_id))


def wait_written(client: redis.Redis, job_id: str, at_least: int, timeout_s: float) -> int:
    """Lines written once `at_least` are (or the job ended, or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        written = num_written(client, job_id)
        if written >= at_least or job_status(client, job_id).get("status") in JOB_END_STATUSES:
            return written
        time.sleep(0.1)
    return num_written(client, job_id)


def wait_job_end(client: redis.Redis, job_id: str, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = job_status(client, job_id)
        if job.get("status") in JOB_END_STATUSES:
            return job
        time.sleep(0.2)
    status = job_status(client, job_id).get("status")
    raise RuntimeError(f"job {job_id} still {status!r} after {timeout_s:g} s")


def cancel_job(gateway_url: str, job_id: str) -> bool:
    """POST /v1/batches/{id}/cancel; False when the job had ended already (409)."""
    request = urllib.request.Request(f"{gateway_url}/v1/batches/{job_id}/cancel", method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=30):
            return True
    except urllib.error.HTTPError as exc:
        if exc.code == 409:
            return False
        raise


class CancelWhenWritten(threading.Thread):
    """Cancels a job once `at_least` of its lines are written (mid-run), on a thread of its own
    so that it acts while the caller runs its chats; `cancelled` says whether it did (False: the
    job ended first)."""

    def __init__(self, redis_url: str, gateway_url: str, job_id: str, at_least: int,
                 timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.redis_url, self.gateway_url, self.job_id = redis_url, gateway_url, job_id
        self.at_least, self.timeout_s = at_least, timeout_s
        self.cancelled = False
        self.num_written_at_cancel = 0

    def run(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        self.num_written_at_cancel = wait_written(client, self.job_id, self.at_least, self.timeout_s)
        self.cancelled = cancel_job(self.gateway_url, self.job_id)
        client.close()


@dataclass
class JobCheck:
    job_id: str
    status: str
    num_lines: int
    num_ok: int = 0
    num_failed: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        verdict = "every line exactly once" if self.passed else "; ".join(self.problems[:5])
        return (f"{self.job_id}: {self.status}, {self.num_lines:,} lines, {self.num_ok:,} answered, "
                f"{self.num_failed:,} not: {verdict}")


def check_job(client: redis.Redis, job_id: str, num_lines: int, *, cancelled: bool = False,
              max_tokens: int | None = None) -> JobCheck:
    """Every line written exactly once (each index and custom_id once); a completed job's lines
    all answered with `max_tokens` tokens; a cancelled one's unanswered lines all cancelled, and
    the job's counts adding up to its lines."""
    job = job_status(client, job_id)
    check = JobCheck(job_id, job.get("status", "?"), num_lines)
    indices: list[int] = []
    custom_ids: set[str] = set()
    last = "-"
    while True:
        entries = client.xrange(Keys().batch_out(job_id), min=f"({last}" if last != "-" else "-", count=1000)
        if not entries:
            break
        for entry_id, fields in entries:
            last = entry_id.decode()
            index = int(fields[b"index"])
            indices.append(index)
            custom_id = fields[b"custom_id"].decode()
            if custom_id in custom_ids:
                check.problems.append(f"{custom_id} written twice")
            custom_ids.add(custom_id)
            line = json.loads(fields[b"line"])
            if fields[b"ok"] == b"1":
                check.num_ok += 1
                tokens = line["response"]["body"]["usage"]["completion_tokens"]
                if max_tokens is not None and tokens != max_tokens:
                    check.problems.append(f"{custom_id}: {tokens} tokens, not {max_tokens}")
            else:
                check.num_failed += 1
                code = (line.get("error") or {}).get("code")
                if not cancelled or code != "batch_cancelled":
                    check.problems.append(f"{custom_id} failed: {code}")
    if sorted(indices) != list(range(num_lines)):
        missing = num_lines - len(set(indices))
        check.problems.append(f"{len(indices)} outputs for {num_lines} lines ({missing} missing)")
    expected = "cancelled" if cancelled else "completed"
    if check.status != expected:
        check.problems.append(f"status {check.status}, expected {expected}")
    if int(job.get("completed", 0)) + int(job.get("failed", 0)) != num_lines:
        check.problems.append(f"counts {job.get('completed')} + {job.get('failed')} != {num_lines}")
    return check


class TokenMeter:
    """The fleet's generated tokens over time, from its schedulers' heartbeats (the registry's
    live schedulers' num_generation_tokens, written every --heartbeat-s): polled every
    `interval_s`, each change kept with the time it was seen."""

    def __init__(self, redis_url: str, interval_s: float = 0.05) -> None:
        self.client = redis.Redis.from_url(redis_url)
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (perf_counter when seen, total tokens)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TokenMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    def _total(self) -> int:
        live = registry.read_live(self.client, Keys(), [registry.SCHEDULERS])[registry.SCHEDULERS]
        return sum(int(float(beat[b"num_generation_tokens"])) for beat in live.values()
                   if b"num_generation_tokens" in beat)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = self._total()
            if not self.samples or total != self.samples[-1][1]:
                self.samples.append((time.perf_counter(), total))
            self._stop.wait(self.interval_s)

    def rate(self, start: float, end: float) -> float:
        """Tokens per second between the first heartbeats seen after `start` and before `end`."""
        tokens, t0, t1 = self.tokens(start, end)
        return tokens / (t1 - t0) if t1 > t0 else float("nan")

    def tokens(self, start: float, end: float) -> tuple[int, float, float]:
        """The tokens generated between the first heartbeat seen after `start` and the last one
        before `end`, and when those two were seen (the same time twice: fewer than two)."""
        inside = [(t, n) for t, n in self.samples if start <= t <= end]
        if len(inside) < 2:
            return 0, start, start
        (t0, n0), (t1, n1) = inside[0], inside[-1]
        return n1 - n0, t0, t1

    def halves(self, start: float, end: float) -> tuple[float, float]:
        """The rates of a window's two halves (each between the heartbeats inside it): whether
        the load was level across the window, or still ramping up or draining."""
        middle = (start + end) / 2
        return self.rate(start, middle), self.rate(middle, end)


def step_costs(client: redis.Redis) -> list[list[list[float]]]:
    """Each scheduler's step cost model as its heartbeat carries it: [tokens, ms] points."""
    live = registry.read_live(client, Keys(), [registry.SCHEDULERS])[registry.SCHEDULERS]
    return [json.loads(beat[b"step_cost_ms"]) for _, beat in sorted(live.items())
            if beat.get(b"step_cost_ms")]


@dataclass
class ChatLatency:
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    num_ok: int
    num_failed: int
    tok_s: float

    @classmethod
    def of(cls, results: list) -> ChatLatency:
        """From tokenfleet bench's results (streamed chats, timestamped chunks)."""
        ok = [r for r in results if r.ok]
        ttft = [r.first_token - r.started for r in ok]
        itl = [gap for r in ok for gap in r.gaps]
        e2e = [r.finished - r.started for r in ok]
        first = min((r.started for r in results), default=0.0)
        last = max((r.finished for r in ok), default=first)
        return cls(percentile(ttft, 50), percentile(ttft, 99), percentile(itl, 50), percentile(itl, 99),
                   percentile(e2e, 50), len(ok), len(results) - len(ok),
                   sum(r.output_tokens for r in ok) / max(1e-9, last - first))


# The goals beside a batch job, as ratios to the chats alone: (name, attribute, at most).
GOALS = (("TTFT p50", "ttft_p50", 1.5), ("TTFT p99", "ttft_p99", 3.0), ("ITL p50", "itl_p50", 1.5),
         ("ITL p99", "itl_p99", 2.5), ("end-to-end p50", "e2e_p50", None))
THROUGHPUT_GOAL = 0.85  # the fleet's output while both run, of the batch alone


def print_table(alone: ChatLatency, beside: ChatLatency, both_tok_s: float, batch_tok_s: float,
                checks: list[JobCheck], costs: list[list[list[float]]] = ()) -> bool:
    """The chats' latency alone, beside the batch, and the ratios; the fleet's output while both
    ran against the batch alone; the jobs' checks. True when every goal is met."""
    met = True

    def value(latency: ChatLatency, attr: str) -> str:
        seconds = getattr(latency, attr)
        return f"{seconds:.2f} s" if attr == "e2e_p50" else f"{seconds * 1e3:.1f} ms"

    print("| chats | " + " | ".join(name for name, _, _ in GOALS) + " | ok / failed |")
    print("| --- |" + " ---: |" * (len(GOALS) + 1))
    for label, latency in (("alone", alone), ("beside the batch job", beside)):
        print(f"| {label} | " + " | ".join(value(latency, attr) for _, attr, _ in GOALS)
              + f" | {latency.num_ok} / {latency.num_failed} |")
    cells = []
    for _, attr, goal in GOALS:
        ratio = getattr(beside, attr) / getattr(alone, attr)
        ok = goal is None or ratio <= goal
        met = met and ok
        cells.append(f"{ratio:.2f}x" + ("" if goal is None else f" ({'ok' if ok else 'over'} <= {goal:g}x)"))
    print("| ratio | " + " | ".join(cells) + " | |")
    share = both_tok_s / batch_tok_s if batch_tok_s else float("nan")
    throughput_ok = share >= THROUGHPUT_GOAL
    met = met and throughput_ok and not any(c.problems for c in checks) and beside.num_failed == 0
    print(f"\nThe fleet's output while both ran: {both_tok_s:,.0f} tok/s (chats {beside.tok_s:,.0f}); "
          f"the batch job alone: {batch_tok_s:,.0f} tok/s; {share:.2f} of it "
          f"({'ok' if throughput_ok else 'under'} >= {THROUGHPUT_GOAL:g})")
    print("\nBatch jobs:")
    for check in checks:
        print(f"- {check}")
    for points in costs:
        print("\nThe scheduler's step cost model (tokens: ms), as its step budget used it at the end: "
              + ", ".join(f"{tokens:,.0f}: {ms:.1f}" for tokens, ms in points))
    return met
