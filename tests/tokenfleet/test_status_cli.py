"""`tokenfleet status` and the scheduler's reporting flags on bad input: one clear line, exit 1."""

from __future__ import annotations

import json

import redis

from shared.net import free_port
from tests.gateway.corrupt_jobs import CORRUPT, GOOD_ID, check_rows, write_records
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


def test_status_lists_a_corrupt_batch_record_as_failed_and_the_rest_as_they_are(redis_server,
                                                                                capsys) -> None:
    write_records(redis.Redis.from_url(redis_server.url))
    assert main(["status", "--redis-url", redis_server.url]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.split("Batch jobs:")[1].split("Gateways:")[0].splitlines()
            if line.strip() and not line.strip().startswith("ID")}
    assert "completed" in rows[GOOD_ID], out
    for job_id, (_, bad_field) in CORRUPT.items():
        assert "failed" in rows[job_id], out
        assert f"{job_id}: the job's record is corrupt: its field {bad_field!r}" in out, out
    assert main(["status", "--redis-url", redis_server.url, "--json"]) == 0
    check_rows(json.loads(capsys.readouterr().out)["batch_jobs"])


def test_scheduler_refuses_no_publisher_process(capsys) -> None:
    assert main(["scheduler", "--publisher-processes", "0"]) == 1
    assert "--publisher-processes must be >= 1" in capsys.readouterr().err


def test_status_shows_each_schedulers_lora_adapters(redis_server, capsys) -> None:
    from protocol import registry
    from protocol.keys import Keys

    client = redis.Redis.from_url(redis_server.url)
    client.hset(Keys().scheduler("s1"), mapping={"model": "m", "loras": '["chat", "sql"]',
                                                 "loras_loaded": '["sql"]'})
    registry.beat(client, Keys(), registry.SCHEDULERS, "s1", 30)
    assert main(["status", "--redis-url", redis_server.url]) == 0
    assert "  s1: sql / chat, sql" in capsys.readouterr().out
