"""The chaos harness's checks (testkit/chaos/harness.py): what the fleet promised, judged from what
the clients saw, what Redis holds, and the reference run. Each check returns or records the
problems it finds, worded for the report."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field

import redis

from protocol.keys import CONSUMER_GROUP, INGESTER_GROUP, Keys
from testkit.chaos.clients import Outcome

_KEYS = [Keys()]  # the fleet's keys (use_keys: a cluster's, with its partitions)


def use_keys(keys: Keys) -> None:
    _KEYS[0] = keys


def fleet_keys() -> Keys:
    return _KEYS[0]


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        self.lines.append(line)

    def violation(self, text: str) -> None:
        self.violations.append(text)


def check_events(out: Outcome, want_ids: list[int]) -> list[str]:
    """A resumable event stream, across its reconnects: sequence numbers only go up (a
    catch-up from the record is one event carrying several steps' tokens, numbered as the
    last of them), the tokens put together are the reference's: no gap, no repeat; and it
    ended once."""
    problems = []
    if any(b <= a for a, b in zip(out.seqs, out.seqs[1:], strict=False)):
        problems.append(f"event seqs repeat or go back: {out.seqs[:40]}")
    if out.token_ids != want_ids:
        problems.append(f"event tokens differ from the reference: {out.token_ids[:40]} vs {want_ids[:40]}")
    if out.num_final_events != 1:
        problems.append(f"{out.num_final_events} final events")
    return problems


def check_request(out: Outcome, view: dict, want_text: str, want_ids: list[int]) -> list[str]:
    """One accepted request's end, against what its client saw and the reference."""
    allowed = {"completed"} if out.kind in ("resume", "poll") or (out.kind == "stream" and out.is_done) \
        else {"completed", "cancelled"}
    problems = []
    if view["status"] not in allowed:
        problems.append(f"ended {view['status']} ({view.get('error')}), expected {sorted(allowed)}")
    output = view["output"]
    if view["status"] == "completed":
        if output["text"] != want_text or output["num_tokens"] != len(want_ids):
            problems.append(f"output differs from the reference: {output['num_tokens']} tokens "
                            f"{output['text'][:60]!r} vs {len(want_ids)} {want_text[:60]!r}")
    elif not want_text.startswith(output["text"]):
        problems.append(f"partial output is not a prefix of the reference: {output['text'][:60]!r}")
    if out.kind in ("stream", "disconnect") and not want_text.startswith(out.text):
        problems.append(f"the stream's text is not a prefix of the reference: {out.text[:60]!r}")
    if out.kind == "stream" and out.is_done and out.text != want_text:
        problems.append(f"the stream ended but its text differs: {out.text[:60]!r}")
    if out.kind == "resume":
        problems += check_events(out, want_ids)
    return problems


def check_batch(client: redis.Redis, job_id: str, custom_ids: list[str], want_texts: list[str]) -> list[str]:
    problems = []
    job = {k.decode(): v.decode() for k, v in client.hgetall(fleet_keys().batch_job(job_id)).items()}
    if job.get("status") != "completed":
        problems.append(f"batch job {job_id} is {job.get('status')}: {job}")
    written = collections.Counter()
    for _, fields in client.xrange(fleet_keys().batch_out(job_id)):
        line = json.loads(fields[b"line"])
        written[line["custom_id"]] += 1
        index = int(fields[b"index"])
        body = (line.get("response") or {}).get("body") or {}
        text = body.get("choices", [{}])[0].get("text")
        if text != want_texts[index]:
            problems.append(f"batch line {line['custom_id']}: output differs: {str(text)[:60]!r} / {line}")
    for custom_id in custom_ids:
        if written[custom_id] != 1:
            problems.append(f"batch line {custom_id} written {written[custom_id]} times")
    return problems


def _consumer_streams(model: str) -> list[tuple[str, str]]:
    """(stream, group) of every stream a consumer group reads: each partition's."""
    keys = fleet_keys()
    streams = [(s, CONSUMER_GROUP) for kind in ("interactive", "batch")
               for s in keys.request_streams(model, kind)]
    streams.append((keys.batch_in, INGESTER_GROUP))
    return streams + [(s, INGESTER_GROUP) for s in keys.batch_done_streams]


def pending_entries(client: redis.Redis, model: str) -> dict[str, int]:
    """Entries delivered to a consumer and not acknowledged, per stream and group."""
    streams = _consumer_streams(model)
    left = {}
    for stream, group in streams:
        try:
            count = client.xpending(stream, group)["pending"]
        except redis.ResponseError:  # no such stream or group: nothing pending
            continue
        if count:
            left[f"{stream} ({group})"] = count
    return left


def pending_details(client: redis.Redis, model: str, limit: int = 5) -> list[str]:
    """For a report: who holds the oldest pending entries, how long, and whether each still
    exists in its stream (an entry deleted while pending can jam a takeover)."""
    details = []
    streams = _consumer_streams(model)
    for stream, group in streams:
        try:
            pending = client.xpending_range(stream, group, "-", "+", limit)
        except redis.ResponseError:
            continue
        for entry in pending:
            entry_id = entry["message_id"]
            exists = bool(client.xrange(stream, entry_id, entry_id))
            details.append(f"{stream} {entry_id.decode()}: owner {entry['consumer'].decode()}, idle "
                           f"{entry['time_since_delivered'] / 1000:.0f} s, delivered "
                           f"{entry['times_delivered']}x, {'in' if exists else 'deleted from'} the stream")
    return details


def check_rss(first: dict[int, tuple[str, float, float]], last: dict[int, tuple[float, float]],
              limit_mb: float, min_span_s: float, report: Report) -> None:
    """Per role, the process watched longest: its RSS then and at its last sample. Growth
    over limit_mb in any process watched for min_span_s or more is a violation.
    first: pid -> (role, time, MB) of its first sample; last: pid -> (time, MB)."""
    longest: dict[str, tuple[float, int]] = {}  # role -> (seconds watched, pid)
    for pid, (role, start, _) in first.items():
        span = last[pid][0] - start
        if span > longest.get(role, (-1.0, 0))[0]:
            longest[role] = (span, pid)
        growth = last[pid][1] - first[pid][2]
        if span >= min_span_s and growth > limit_mb:
            report.violation(f"RSS of {role} (pid {pid}) grew {growth:.1f} MB in {span:.0f} s "
                             f"(> {limit_mb:g})")
    rows = []
    for role, (span, pid) in sorted(longest.items()):
        start_mb, end_mb = first[pid][2], last[pid][1]
        rows.append(f"{role} {start_mb:.0f} -> {end_mb:.0f} MB ({end_mb - start_mb:+.1f}) over {span:.0f} s")
    report.add("RSS, the longest-lived process of each role: " + ("; ".join(rows) or "none"))


def wait_batch(store: redis.Redis, job_id: str, custom_ids: list[str], want_texts: list[str],
                timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = store.hget(fleet_keys().batch_job(job_id), "status")
            if status in (b"completed", b"failed", b"cancelled", b"expired"):
                break
        except redis.ConnectionError:
            pass
        time.sleep(0.5)
    return check_batch(store, job_id, custom_ids, want_texts)


def wait_no_pending(store: redis.Redis, model: str, timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = pending_entries(store, model)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
