"""--redis-url and --redis-password-file on the commands: a password-protected Redis is
reached with the file's password, and refused without it in one clear line."""

from __future__ import annotations

import pytest

from tokenfleet.cli import build_parser, main
from tokenfleet.redis_server import RedisServer

PASSWORD = "hunter2 but longer"


@pytest.fixture
def protected_redis(tmp_path):
    server = RedisServer(tmp_path / "redis", password=PASSWORD)
    server.start()
    yield server
    server.stop()


def test_every_command_with_a_redis_url_takes_a_password_file() -> None:
    parser = build_parser()
    for argv in (["gateway"], ["scheduler"], ["up"], ["batch", "status", "job"], ["batch", "ingester"],
                 ["batch", "submit", "f.jsonl"], ["batch", "cancel", "job"], ["batch", "results", "job"]):
        args = parser.parse_args([*argv, "--redis-password-file", "/secret"])
        assert args.redis_password_file == "/secret", argv


def test_batch_status_reaches_redis_with_the_password_file_and_not_without(protected_redis, tmp_path,
                                                                           capsys) -> None:
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    url = f"redis://127.0.0.1:{protected_redis.port}/0"
    with_file = ["--redis-url", url, "--redis-password-file", str(password_file)]
    assert main(["batch", "status", "nope", *with_file]) == 1
    assert "no batch job 'nope'" in capsys.readouterr().err  # Redis answered: authenticated
    assert main(["batch", "status", "nope", "--redis-url", url]) == 1
    error = capsys.readouterr().err
    assert error.startswith("tokenfleet: error:") and "authenticated" in error
    assert len(error.splitlines()) == 1
    wrong = tmp_path / "wrong"
    wrong.write_text("not it")
    assert main(["batch", "status", "nope", "--redis-url", url, "--redis-password-file", str(wrong)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("tokenfleet: error:") and "password" in error and len(error.splitlines()) == 1
