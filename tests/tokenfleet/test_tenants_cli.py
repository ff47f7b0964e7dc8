"""`tokenfleet tenants` finds the fleet's Redis as `status` and `batch` do ($TOKENFLEET_HOME/
fleet.json when no --redis-url says otherwise), and an unreachable Redis is one line naming it."""

from __future__ import annotations

import json

import pytest
import redis

from shared.net import free_port
from tokenfleet.cli import main


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def _record_fleet(home, redis_url: str) -> None:
    (home / "fleet.json").write_text(json.dumps({"redis_url": redis_url, "gateway_url": "http://127.0.0.1:1"}))


def test_tenants_uses_the_redis_of_fleet_json(home, redis_server, capsys) -> None:
    _record_fleet(home, redis_server.url)
    assert main(["tenants", "set", "team-a", "--key", "sk-a", "--requests-per-minute", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["limits"] == {"requests_per_minute": 5}
    assert redis.Redis.from_url(redis_server.url).hget("tf:tenant:team-a", "requests_per_minute") == b"5"
    assert main(["tenants", "show", "team-a"]) == 0
    assert json.loads(capsys.readouterr().out)["num_keys"] == 1


@pytest.mark.parametrize("where", ["flag", "fleet.json"])
def test_tenants_names_the_redis_it_cannot_reach_in_one_line(home, capsys, where) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    flags = ["--redis-url", url] if where == "flag" else []
    if where == "fleet.json":
        _record_fleet(home, url)
    assert main(["tenants", "show", "team-a", *flags]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"tokenfleet: error: cannot reach Redis at {url}"), lines
