"""`tokenfleet tenants set|show|remove`: tenants kept in Redis (read by gateways started with
`--tenants-from-redis`), so keys and limits change without restarting a gateway. Redis is
`--redis-url`, else the fleet's from $TOKENFLEET_HOME/fleet.json (like `status` and `batch`)."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import redis

from gateway.tenants.directory import TenantLimits, key_digest
from protocol.keys import TENANT_PATTERN, Keys, keys_for
from shared.errors import InvalidRequestError, TokenfleetError
from shared.redis_client import connect
from shared.redis_url import redacted

LIMIT_NAMES = [f.name for f in fields(TenantLimits)]


def run_tenants_command(args) -> int:
    if not re.match(TENANT_PATTERN, args.tenant):
        raise InvalidRequestError(f"tenant {args.tenant!r} must match {TENANT_PATTERN}", param="tenant")
    keys = keys_for(args.redis_url, args.key_prefix)
    client = connect(args.redis_url, socket_connect_timeout=5, socket_timeout=10)
    try:
        if args.tenants_command == "set":
            return _set(client, keys, args)
        if args.tenants_command == "remove":
            return _remove(client, keys, args.tenant)
        return _show(client, keys, args.tenant)
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        if isinstance(exc, redis.AuthenticationError):
            raise  # the command line's own message for a refused password
        raise TokenfleetError(f"cannot reach Redis at {redacted(args.redis_url)}: {exc}") from None
    finally:
        client.close()


def _set(client: redis.Redis, keys: Keys, args) -> int:
    limits = {name: getattr(args, name) for name in LIMIT_NAMES if getattr(args, name) is not None}
    for name, value in limits.items():
        if value < 0:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 0 (0: no limit), got {value}",
                                      param=name)
    pipe = client.pipeline(transaction=True)
    for name, value in limits.items():
        if value == 0:
            pipe.hdel(keys.tenant(args.tenant), name)
        else:
            pipe.hset(keys.tenant(args.tenant), name, value)
    pipe.hset(keys.tenant(args.tenant), "name", args.tenant)  # the tenant exists, limits or not
    for api_key in args.key or []:
        pipe.hset(keys.api_keys, key_digest(api_key), args.tenant)
    pipe.execute()
    return _show(client, keys, args.tenant)


def _remove(client: redis.Redis, keys: Keys, tenant: str) -> int:
    digests = [d for d, owner in client.hgetall(keys.api_keys).items() if owner.decode() == tenant]
    pipe = client.pipeline(transaction=True)
    if digests:
        pipe.hdel(keys.api_keys, *digests)
    pipe.delete(keys.tenant(tenant))
    pipe.execute()
    print(json.dumps({"tenant": tenant, "removed": True, "keys_removed": len(digests)}))
    return 0


def _show(client: redis.Redis, keys: Keys, tenant: str) -> int:
    raw = client.hgetall(keys.tenant(tenant))
    if not raw:
        raise InvalidRequestError(f"no tenant {tenant!r} in Redis", param="tenant")
    num_keys = sum(1 for owner in client.hvals(keys.api_keys) if owner.decode() == tenant)
    limits = {name: int(raw[name.encode()]) for name in LIMIT_NAMES if name.encode() in raw}
    print(json.dumps({"tenant": tenant, "limits": limits, "num_keys": num_keys,
                      "in_flight": client.zcard(keys.tenant_leases(tenant))}))
    return 0
