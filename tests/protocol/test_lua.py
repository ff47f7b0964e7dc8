"""The fleet's Lua scripts live in protocol/lua/<name>.lua, each with its KEYS and ARGV named in a
header, and none is written inline in a Python module (issue 26); the loader fills placeholders,
and calls them by sha in pipelines, loading a script a Redis lacks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import redis

from protocol import lua

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("gateway", "service", "protocol", "scheduler", "workers", "shared", "tokenfleet")
SCRIPTS = sorted(p.stem for p in (REPO / "protocol" / "lua").glob("*.lua"))
PARTS = {"batch_finish_check"}  # a part other scripts include, not a script of its own


def test_no_product_module_holds_inline_lua() -> None:
    found = [f"{path.relative_to(REPO)}:{n}" for package in PRODUCT for path in (REPO / package).rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if "redis.call(" in line]
    assert not found, found


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - PARTS))
def test_each_script_names_its_keys_and_arguments_in_its_header(name: str) -> None:
    source = (REPO / "protocol" / "lua" / f"{name}.lua").read_text()
    header = "\n".join(line for line in source.splitlines() if line.startswith("--"))
    assert header.startswith(f"-- {name}:"), name
    uses_keys = "KEYS[" in source.replace(header, "")
    assert not uses_keys or "KEYS[" in header, f"{name}.lua uses KEYS without naming them"
    assert "ARGV[" not in source.replace(header, "") or "ARGV[" in header, name
    # No key is made inside a script (a cluster could not route it): no concatenation into a call's key.
    body = source.replace(header, "")
    assert not re.search(r"redis\.call\('[A-Z]+', [^,()]*\.\.", body), f"{name}.lua builds a key"


def test_placeholders_left_unfilled_are_an_error() -> None:
    with pytest.raises(ValueError, match="GROUP"):
        lua.load("write_results", TERMINAL="true", PUBLISH="PUBLISH")


def test_calls_are_pipelined_and_a_script_redis_lacks_is_loaded(redis_server) -> None:
    client = redis.Redis.from_url(redis_server.url)
    script = lua.Script("acquire_leases")
    client.script_flush()
    calls = [([f"tf:tenant:t{i}:leases"], [100.0, 200.0, 5, f"r{i}"]) for i in range(3)]
    assert script.run_many(client, calls) == [-1, -1, -1]  # refused (NOSCRIPT), loaded, sent again
    assert client.zrange("tf:tenant:t1:leases", 0, -1) == [b"r1"]
    client.script_flush()
    assert script.run(client, ["tf:tenant:t9:leases"], [100.0, 200.0, 0, "r9"]) == 0  # over its cap
