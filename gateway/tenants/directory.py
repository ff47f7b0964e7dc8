"""Tenants: who an API key belongs to, and that tenant's limits.

The keys file (`tokenfleet gateway --tenants-file tenants.json`) maps tenants to their keys
and limits; a limit left out is no limit:

    {"tenants": {
        "team-a": {"keys": ["sk-a-1", "sk-a-2"], "requests_per_minute": 600,
                   "tokens_per_minute": 200000, "max_concurrent_requests": 32,
                   "max_batch_lines_in_flight": 2000},
        "team-b": {"keys": ["sk-b"]},
        "ops": {"keys": ["sk-ops"], "admin": true}}}

An admin tenant's keys see every tenant's requests, files and batch jobs, and the fleet-wide
views (/fleet.json, /metrics); any other tenant sees its own only (gateway/tenants/access.py).

Keys are held as SHA-256 digests and looked up by digest, so neither the lookup's timing nor
a memory dump gives a key away.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path

from protocol.keys import TENANT_PATTERN
from shared.errors import InvalidRequestError

_TENANT = re.compile(TENANT_PATTERN)


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt tokens + max_tokens of each request, charged up front
    max_concurrent_requests: int | None = None  # queued or running, from any API
    max_batch_lines_in_flight: int | None = None  # batch lines queued and not yet written

    @classmethod
    def from_map(cls, raw: dict, where: str) -> TenantLimits:
        values = {}
        for f in fields(cls):
            value = raw.get(f.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidRequestError(f"{where}: {f.name} must be an integer >= 1, got {value!r}",
                                          param="tenants-file")
            values[f.name] = value
        return cls(**values)


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits
    is_admin: bool = False  # sees every tenant's work and the fleet-wide views


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class TenantDirectory:
    """API key -> tenant."""

    def __init__(self, tenants_by_digest: dict[str, Tenant]) -> None:
        self._by_digest = tenants_by_digest

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    @property
    def tenants(self) -> list[Tenant]:
        return list({t.name: t for t in self._by_digest.values()}.values())

    def lookup(self, api_key: str) -> Tenant | None:
        return self._by_digest.get(key_digest(api_key))

    def get(self, name: str) -> Tenant | None:
        """The tenant of that name (its limits may have changed since a job recorded it)."""
        return next((t for t in self._by_digest.values() if t.name == name), None)

    @classmethod
    def empty(cls) -> TenantDirectory:
        return cls({})

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise InvalidRequestError(f"cannot read the tenants file {str(path)!r}: {exc.strerror}",
                                      param="tenants-file") from None
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the tenants file {str(path)!r} is not JSON: {exc}",
                                      param="tenants-file") from None
        return cls.from_map(raw, str(path))

    @classmethod
    def from_map(cls, raw: object, where: str = "tenants") -> TenantDirectory:
        if not isinstance(raw, dict) or not isinstance(raw.get("tenants"), dict):
            raise InvalidRequestError(f'{where}: expected {{"tenants": {{name: {{"keys": [...], ...}}}}}}',
                                      param="tenants-file")
        by_digest: dict[str, Tenant] = {}
        known = {f.name for f in fields(TenantLimits)} | {"keys", "admin"}
        for name, spec in raw["tenants"].items():
            if not _TENANT.match(name):
                raise InvalidRequestError(f"{where}: tenant name {name!r} must match {TENANT_PATTERN}",
                                          param="tenants-file")
            if not isinstance(spec, dict):
                raise InvalidRequestError(f"{where}: tenant {name!r} must be an object", param="tenants-file")
            unknown = set(spec) - known
            if unknown:
                raise InvalidRequestError(f"{where}: tenant {name!r} has unknown fields {sorted(unknown)}",
                                          param="tenants-file")
            keys = spec.get("keys")
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
                raise InvalidRequestError(f"{where}: tenant {name!r} needs a non-empty list of string keys",
                                          param="tenants-file")
            is_admin = spec.get("admin", False)
            if not isinstance(is_admin, bool):
                raise InvalidRequestError(f"{where}: tenant {name!r}: admin must be true or false, "
                                          f"got {is_admin!r}", param="tenants-file")
            tenant = Tenant(name, TenantLimits.from_map(spec, f"{where}: tenant {name!r}"), is_admin)
            for key in keys:
                digest = key_digest(key)
                if digest in by_digest:
                    raise InvalidRequestError(f"{where}: a key of tenant {name!r} is listed twice",
                                              param="tenants-file")
                by_digest[digest] = tenant
        return cls(by_digest)
