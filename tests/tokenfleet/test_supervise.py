"""The restart policy (pure) and the supervisor on small real child processes."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from tokenfleet.supervise import NEVER_RESTART, ChildGaveUp, RestartPolicy, Supervisor, tail_lines

POLICY = RestartPolicy(initial_delay_s=0.5, max_delay_s=4.0, min_uptime_s=10.0, max_fast_failures=5)


def test_fast_failures_double_the_delay_up_to_the_cap_and_the_fifth_gives_up() -> None:
    delays, failures = [], 0
    for _ in range(4):
        delay, failures = POLICY.after_exit(1.0, failures)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0]
    assert POLICY.after_exit(1.0, failures) == (None, 5)
    capped = RestartPolicy(initial_delay_s=1.0, max_delay_s=3.0, max_fast_failures=10)
    assert capped.after_exit(0.0, 6)[0] == 3.0


def test_a_run_that_lasted_resets_the_count_and_restarts_promptly() -> None:
    assert POLICY.after_exit(60.0, 4) == (0.5, 0)
    assert POLICY.after_exit(10.0, 4) == (0.5, 0)  # min_uptime_s itself counts as lasting


def test_a_child_that_is_never_restarted_gives_up_on_its_first_exit() -> None:
    assert NEVER_RESTART.after_exit(3600.0, 0) == (None, 0)


def _wait_for(condition, supervisor: Supervisor, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        supervisor.poll()
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_killed_child_is_started_again_with_a_new_pid(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    quick = RestartPolicy(initial_delay_s=0.05, min_uptime_s=0.0)
    try:
        first = supervisor.add("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], policy=quick)
        os.kill(first, signal.SIGKILL)
        _wait_for(lambda: supervisor.pid("sleeper") not in (None, first), supervisor)
        assert supervisor.num_restarts("sleeper") == 1
        second = supervisor.pid("sleeper")
        os.kill(second, 0)  # alive
    finally:
        supervisor.stop_all()
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)
    assert supervisor.names() == []


def test_repeated_fast_failures_give_up_naming_the_child_and_its_last_lines(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    policy = RestartPolicy(initial_delay_s=0.01, max_delay_s=0.05, min_uptime_s=30.0, max_fast_failures=3)
    script = ("import sys; print('loading the model'); print('boom: no such file', file=sys.stderr); "
              "sys.exit(3)")
    supervisor.add("scheduler-0", [sys.executable, "-c", script], policy=policy)
    deadline = time.monotonic() + 20
    with pytest.raises(ChildGaveUp) as caught:
        while time.monotonic() < deadline:
            supervisor.poll()
            time.sleep(0.02)
    message = str(caught.value)
    assert message.startswith("scheduler-0 exited with code 3; 3 runs in a row lasted under 30 s")
    assert "| boom: no such file" in message and "| loading the model" in message
    assert supervisor.num_restarts("scheduler-0") == 2


def test_children_are_added_and_stopped_at_runtime_and_a_stopped_one_stays_stopped(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    def argv(name: str) -> list[str]:  # (says when its handler is installed: a file appears)
        return [sys.executable, "-c", "import signal, sys, time; "
                "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); open(sys.argv[1], 'w').close(); "
                "time.sleep(60)", str(tmp_path / f"{name}.ready")]

    try:
        supervisor.add("a", argv("a"))
        supervisor.add("b", argv("b"))
        with pytest.raises(ValueError, match="'a' is already supervised"):
            supervisor.add("a", argv("a"))
        deadline = time.monotonic() + 60
        while not (tmp_path / "a.ready").exists():  # (a loaded machine starts Python slowly)
            assert time.monotonic() < deadline, "the child never installed its handler"
            time.sleep(0.02)
        assert supervisor.stop("a", graceful=True) == 7  # SIGTERM reached it
        supervisor.poll()
        assert supervisor.names() == ["b"]
        assert supervisor.stop("b", graceful=False) == -signal.SIGKILL
    finally:
        supervisor.stop_all()


def test_a_child_that_exits_while_starting_is_reported_at_once(tmp_path) -> None:
    supervisor = Supervisor(tmp_path)
    supervisor.add("gateway", [sys.executable, "-c", "print('cannot listen'); raise SystemExit(1)"])
    deadline = time.monotonic() + 20
    expected = r"gateway exited with code 1; it exited while the fleet was starting(.|\n)*\| cannot listen"
    with pytest.raises(ChildGaveUp, match=expected):
        while time.monotonic() < deadline:
            supervisor.check_all_running()
            time.sleep(0.02)
    supervisor.stop_all()


def test_tail_lines_reads_the_end_of_a_long_log(tmp_path) -> None:
    path = tmp_path / "x.log"
    path.write_text("".join(f"line {i}\n" for i in range(10000)))
    assert tail_lines(path, 3) == ["line 9997", "line 9998", "line 9999"]
    assert tail_lines(tmp_path / "missing.log", 3) == []


def test_up_waits_until_a_child_is_given_up_and_names_it(tmp_path, monkeypatch) -> None:
    """Fleet.wait (what `tokenfleet up` runs once the fleet is up) restarts through the
    supervisor and ends with ChildGaveUp, which the CLI prints as its one-line error."""
    from tokenfleet.up import Fleet, FleetOptions

    monkeypatch.setenv("TOKENFLEET_HOME", str(tmp_path))
    fleet = Fleet(FleetOptions(model=str(tmp_path), model_name="m"))
    policy = RestartPolicy(initial_delay_s=0.01, max_delay_s=0.02, min_uptime_s=60.0, max_fast_failures=2)
    argv = [sys.executable, "-c", "print('no model here'); raise SystemExit(2)"]
    fleet.supervisor.add("batch-ingester-0", argv, policy=policy)
    try:
        with pytest.raises(ChildGaveUp, match=r"^batch-ingester-0 exited with code 2(.|\n)*\| no model here"):
            fleet.wait(lambda: False)
    finally:
        fleet.stop()
    assert (tmp_path / "logs" / "batch-ingester-0.log").read_text().count("no model here") == 2
