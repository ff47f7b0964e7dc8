"""The chaos harness (testkit/chaos/, run by scripts/chaos.py): its checks catch what they are
meant to catch, and its short run finds no violation in the fleet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def chaos():
    from testkit.chaos import harness

    return harness


@pytest.fixture(scope="module")
def checks():
    from testkit.chaos import checks

    return checks


def _resume(seqs: list[int], token_ids: list[int], num_final_events: int = 1):
    from testkit.chaos.clients import Outcome

    return Outcome("resume", 0, req_id="r", seqs=seqs, token_ids=token_ids, num_final_events=num_final_events,
                   is_done=True)


def test_event_checks_accept_a_catch_up_and_catch_repeats_gaps_and_double_endings(checks):
    want = [5, 6, 7, 8]
    assert checks.check_events(_resume([1, 2, 4], want), want) == []  # seq 4 caught up 3 and 4
    assert "repeat or go back" in checks.check_events(_resume([1, 2, 2, 3], want), want)[0]
    assert "differ from the reference" in checks.check_events(_resume([1, 2, 3], [5, 6, 8]), want)[0]
    assert "differ from the reference" in checks.check_events(_resume([1, 2, 3, 4, 5], want + [8]), want)[0]
    assert checks.check_events(_resume([1, 2, 3, 4], want, num_final_events=2), want) == ["2 final events"]


def test_request_checks_hold_each_kind_to_its_own_ending(checks):
    from testkit.chaos.clients import Outcome

    def view(status: str, text: str, num_tokens: int) -> dict:
        return {"status": status, "output": {"text": text, "num_tokens": num_tokens}}

    poll = Outcome("poll", 0, req_id="r", is_done=True)
    assert checks.check_request(poll, view("completed", "abcd", 4), "abcd", [1, 2, 3, 4]) == []
    want_ids = [1, 2, 3, 4]
    assert "ended cancelled" in checks.check_request(poll, view("cancelled", "ab", 2), "abcd", want_ids)[0]
    assert "differs" in checks.check_request(poll, view("completed", "abcdcd", 6), "abcd", [1, 2, 3, 4])[0]
    cancel = Outcome("cancel", 0, req_id="r")
    assert checks.check_request(cancel, view("cancelled", "ab", 2), "abcd", [1, 2, 3, 4]) == []
    assert "not a prefix" in checks.check_request(cancel, view("cancelled", "ax", 2), "abcd", [1, 2, 3, 4])[0]
    broken = Outcome("stream", 0, req_id="r", text="abx", is_broken=True)
    problems = checks.check_request(broken, view("completed", "abcd", 4), "abcd", [1, 2, 3, 4])
    assert "stream's text" in problems[0]


def _pythonpath() -> str:
    return os.pathsep.join([str(SCRIPTS.parent), os.environ.get("PYTHONPATH", "")])


@pytest.mark.slow
def test_a_short_chaos_run_loses_nothing_and_repeats_nothing():
    done = subprocess.run(
        # 30 s of faults, one every 2-6 s (the kinds of process in turn, each victim at least 12 s
        # old): more than the three asked for below, as many as a minute at the default interval.
        [sys.executable, str(SCRIPTS / "chaos.py"), "--minutes", "0.5", "--fault-interval-s", "4", "--short",
         "--seed", "1"],
        capture_output=True, text=True, timeout=1200,
        env={**os.environ, "PYTHONPATH": _pythonpath()},
    )
    report = done.stdout[done.stdout.find("chaos report"):]
    assert done.returncode == 0, report + done.stderr[-3000:]
    assert "violations: 0" in report
    faults = int(report.split("faults injected: ")[1].split()[0])
    accepted = int(report.split("requests accepted: ")[1].split()[0])
    assert faults >= 3 and accepted >= 5, report


def test_rss_growth_counts_only_processes_watched_long_enough(chaos, checks):
    watch = chaos.RssWatch(up_pid=0)
    watch.first = {1: ("scheduler", 0.0, 300.0), 2: ("gateway", 0.0, 100.0), 3: ("redis", 0.0, 5.0)}
    watch.last = {1: (600.0, 301.0), 2: (30.0, 400.0), 3: (600.0, 205.0)}
    report = checks.Report()
    checks.check_rss(watch.first, watch.last, limit_mb=100.0, min_span_s=120.0, report=report)
    # not the gateway: watched for 30 s only
    assert report.violations == ["RSS of redis (pid 3) grew 200.0 MB in 600 s (> 100)"]
    assert "scheduler 300 -> 301 MB (+1.0) over 600 s" in report.lines[0]
