"""`tokenfleet status` and the scheduler's reporting flags on bad input: one clear line, exit 1."""

from __future__ import annotations

from shared.net import free_port
from tokenfleet.cli import main


def test_status_names_the_redis_it_cannot_reach(capsys) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    assert main(["status", "--redis-url", url]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("tokenfleet: error: cannot read the fleet from") and url in error


def test_status_of_an_empty_redis_says_so(redis_server, capsys) -> None:
    assert main(["status", "--redis-url", redis_server.url]) == 0
    out = capsys.readouterr().out
    for text in ("0 scheduler(s), 0 gateway(s)", "(no live scheduler)", "Dead letters: 0", "(no batch job)"):
        assert text in out, out


def test_scheduler_refuses_a_heartbeat_that_is_not_positive(capsys) -> None:
    assert main(["scheduler", "--heartbeat-s", "0"]) == 1
    assert "--heartbeat-s must be > 0" in capsys.readouterr().err
