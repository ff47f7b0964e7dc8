"""`tokenfleet up --max-n/--max-queue/--api-key/--tenants-from-redis` reach the gateway it starts:
the gateway is built from exactly the command line and environment `up` gives it (Fleet's
gateway_command), on a real Redis, and answers as those flags say."""

from __future__ import annotations

import pytest

from gateway.http.app import create_app
from tests.gateway.conftest import MODEL
from tokenfleet.cli import build_parser, fleet_options, gateway_settings, main
from tokenfleet.up import Fleet


@pytest.mark.asyncio
async def test_ups_gateway_flags_reach_the_gateways_settings(smollm2, redis_server, aiohttp_client,
                                                             monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TOKENFLEET_HOME", str(tmp_path))
    monkeypatch.delenv("TOKENFLEET_API_KEY", raising=False)
    up = build_parser().parse_args(["up", "--model", str(smollm2), "--max-n", "2", "--max-queue", "7",
                                    "--api-key", "sk-1", "--api-key", "sk-2", "--tenants-from-redis"])
    fleet = Fleet(fleet_options(up))
    fleet.redis_url = redis_server.url  # (what starting its Redis would set)
    argv, env = fleet.gateway_command()
    assert "sk-1" not in " ".join(argv)  # keys travel in the environment, out of `ps`
    assert argv[1:4] == ["-m", "tokenfleet.cli", "gateway"]
    monkeypatch.setenv("TOKENFLEET_API_KEY", env["TOKENFLEET_API_KEY"])  # the gateway's environment
    settings = gateway_settings(build_parser().parse_args(argv[3:]))
    assert (settings.max_n, settings.max_queue, settings.api_keys, settings.tenants_from_redis) == \
        (2, 7, ("sk-1", "sk-2"), True)
    client = await aiohttp_client(create_app(settings))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=body)).status == 401
    headers = {"Authorization": "Bearer sk-2"}
    response = await client.post("/v1/chat/completions", json={**body, "n": 3}, headers=headers)
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == "n" and "at most 2" in error["message"], error


@pytest.mark.parametrize(("flags", "words"), [(["--max-n", "0"], "--max-n must be >= 1"),
                                              (["--max-queue", "-1"], "--max-queue must be >= 0"),
                                              (["--api-key", "a,b"], "--api-key")])
def test_up_refuses_bad_gateway_flags_in_one_line(smollm2, capsys, flags, words) -> None:
    assert main(["up", "--model", str(smollm2), *flags]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], lines
