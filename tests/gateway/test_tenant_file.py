"""The tenants file: keys map to tenants and limits; every mistake is named at start."""

from __future__ import annotations

import json

import pytest

from gateway.tenants.directory import TenantDirectory, TenantLimits
from shared.errors import InvalidRequestError


def test_keys_map_to_their_tenant_and_limits(tmp_path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {
        "team-a": {"keys": ["a1", "a2"], "requests_per_minute": 5, "max_concurrent_requests": 2},
        "team-b": {"keys": ["b1"]}}}))
    directory = TenantDirectory.from_file(path)
    assert directory.lookup("a2").name == "team-a"
    assert directory.lookup("a1").limits == TenantLimits(requests_per_minute=5, max_concurrent_requests=2)
    assert directory.lookup("b1").limits == TenantLimits()
    assert directory.lookup("zz") is None
    assert directory.get("team-b").name == "team-b" and directory.get("nobody") is None
    assert not directory.lookup("a1").is_admin


def test_a_tenant_marked_admin_is_an_admin() -> None:
    directory = TenantDirectory.from_map({"tenants": {"ops": {"keys": ["o1"], "admin": True},
                                                      "team-a": {"keys": ["a1"], "admin": False}}})
    assert directory.lookup("o1").is_admin and not directory.lookup("a1").is_admin


@pytest.mark.parametrize(("tenants", "needle"), [
    ({"bad name!": {"keys": ["k"]}}, "must match"),
    ({"t": {"keys": []}}, "non-empty list of string keys"),
    ({"t": {"keys": ["k"], "requests_per_minute": 0}}, "requests_per_minute must be an integer >= 1"),
    ({"t": {"keys": ["k"], "tokens_per_minute": "lots"}}, "tokens_per_minute must be an integer >= 1"),
    ({"t": {"keys": ["k"], "rpm": 5}}, "unknown fields ['rpm']"),
    ({"t": {"keys": ["k"], "admin": "yes"}}, "admin must be true or false"),
    ({"t": {"keys": ["k"]}, "u": {"keys": ["k"]}}, "listed twice"),
])
def test_mistakes_in_the_file_are_named(tenants: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        TenantDirectory.from_map({"tenants": tenants}, "tenants.json")
    assert needle in error.value.message and error.value.message.startswith("tenants.json")


def test_an_unreadable_or_malformed_file_is_named(tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match="cannot read the tenants file"):
        TenantDirectory.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="is not JSON"):
        TenantDirectory.from_file(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(InvalidRequestError, match='expected {"tenants"'):
        TenantDirectory.from_file(tmp_path / "list.json")
