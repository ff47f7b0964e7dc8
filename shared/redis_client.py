"""The one place a Redis client is made, for a single server or a Redis Cluster.

A cluster is named by `redis+cluster://[user:password@]host:port,host:port[?query]` (or
`rediss+cluster://` for TLS): the listed nodes are only where the client starts; it learns every
shard from them (redis-py's `RedisCluster`, sync and asyncio). Any other URL is one server, as
before (`redis://`, `rediss://`, `unix://`). Every command (scheduler, gateway, status, batch,
tenants, autoscale) connects through `connect` / `connect_async`, so a flag or URL that works for
one works for all.

On a cluster, the fleet splits each request's keys over `CLUSTER_PARTITIONS` hash tags (several
per shard, so slots can move: protocol/keys.py), publishes tokens with sharded pub/sub
(SPUBLISH, Redis >= 7), and a submit counts as accepted once a replica has it (WAIT).

Retries are ours, never redis-py's: a single-server client is made with no retry of its own
(redis-py's `Redis()` retries a failed command up to 10 times by default, a write whose reply
was lost included, and its defaults have changed between versions), so every ConnectionError
or TimeoutError reaches the caller, whose retry is written to be safe to repeat: the result
write skips appends its record's seq already has, a submit of a request already queued queues
nothing, a claim or XCLAIM only sets what it set before. A cluster client keeps its retries
through a failover (FAILOVER_RETRIES), which the same guards make safe.
"""

from __future__ import annotations

import asyncio
import os
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from shared.errors import InvalidRequestError

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
# Partitions of the key space on a cluster: each is a hash tag {p<N>}, so one slot. Sixteen
# spread evenly over 1, 2, 4, 8 or 16 shards and unevenly (6/5/5) over 3; one server needs one.
CLUSTER_PARTITIONS = 16
SINGLE_SERVER_PARTITIONS = 1
# How long a write waits for a replica to confirm it has it (cluster only).
REPLICA_WAIT_MS = 1000
# A cluster client retries a command through a failover (a primary's death is noticed after the
# nodes' timeout, 2 s in tokenfleet/redis_cluster.py, then its replica is elected): up to about
# 12 s of backoff, re-reading the slots between tries, before the caller sees the error.
FAILOVER_RETRIES = 30
FAILOVER_BACKOFF = (0.5, 0.02)  # (cap, base) in seconds


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def partitions_for(url: str) -> int:
    """How many hash-tag partitions the fleet's keys use on this Redis (every process of one
    fleet derives the same number from the same URL)."""
    return CLUSTER_PARTITIONS if is_cluster_url(url) else SINGLE_SERVER_PARTITIONS


def is_cluster_client(client: object) -> bool:
    return isinstance(client, (RedisCluster, AsyncRedisCluster))


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The (host, port) of each node a cluster URL lists."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    nodes = []
    for item in filter(None, netloc.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidRequestError(f"--redis-url: a cluster node must be host:port, got {item!r}",
                                      param="redis-url")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise InvalidRequestError("--redis-url: a redis+cluster:// URL names at least one host:port",
                                  param="redis-url")
    return nodes


def cluster_options(url: str) -> dict:
    """Credentials and TLS options of a cluster URL, as redis-py's cluster clients take them."""
    parts = urlsplit(url)
    options: dict = {}
    userinfo = parts.netloc.rpartition("@")[0]
    if userinfo:
        user, _, password = userinfo.partition(":")
        if password:
            options["password"] = unquote(password)
            if user:
                options["username"] = unquote(user)
    if parts.scheme == "rediss+cluster":
        options["ssl"] = True
    for name, value in parse_qsl(parts.query):
        options[name] = value
    return options


def node_url(url: str, host: str, port: int) -> str:
    """A plain URL for one node of the cluster `url` names, with the same credentials and TLS."""
    parts = urlsplit(url)
    scheme = "rediss" if parts.scheme == "rediss+cluster" else "redis"
    userinfo = parts.netloc.rpartition("@")[0]
    auth = f"{userinfo}@" if userinfo else ""
    query = f"?{parts.query}" if parts.query else ""
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{auth}{host}:{port}{query}"


def _without_implicit_retry(options: dict, retry_class) -> dict:
    """A single server's client options: no retry of redis-py's own (see the module's doc)."""
    options.setdefault("retry", retry_class(NoBackoff(), 0))
    options.setdefault("retry_on_error", [])
    options.setdefault("retry_on_timeout", False)
    return options


def connect(url: str, **options) -> redis.Redis | RedisCluster:
    """A sync client for a single server or a cluster (options: redis-py's, e.g. socket_timeout)."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **_without_implicit_retry(options, Retry))
    options.pop("health_check_interval", None)
    options.setdefault("retry", Retry(ExponentialBackoff(*FAILOVER_BACKOFF), FAILOVER_RETRIES))
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster_nodes(url)],
                        **cluster_options(url), **options)


def connect_async(url: str, *, max_connections: int | None = None, blocking_pool: bool = False,
                  **options) -> aioredis.Redis | AsyncRedisCluster:
    """An asyncio client. `blocking_pool`: a burst waits for one of `max_connections` connections
    instead of failing (the gateway's pool; a cluster client keeps `max_connections` per node)."""
    if is_cluster_url(url):
        options.pop("health_check_interval", None)
        options.pop("timeout", None)  # (a cluster client's per-node pools do not block)
        if max_connections is not None:
            options["max_connections"] = max_connections
        options.setdefault("retry", AsyncRetry(ExponentialBackoff(*FAILOVER_BACKOFF), FAILOVER_RETRIES))
        return AsyncRedisCluster(startup_nodes=[AsyncClusterNode(h, p) for h, p in cluster_nodes(url)],
                                 **cluster_options(url), **options)
    _without_implicit_retry(options, AsyncRetry)
    if blocking_pool:
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, **options)
        return aioredis.Redis.from_pool(pool)  # (the client owns the pool: closing it closes both)
    if max_connections is not None:
        options["max_connections"] = max_connections
    return aioredis.Redis.from_url(url, **options)


def connect_node(host: str, port: int, **options) -> redis.Redis:
    """A sync client for one server by its address (a cluster's node, for its admin commands)."""
    return connect(f"redis://{f'[{host}]' if ':' in host else host}:{port}", **options)


def get_many(client, keys: list[str]) -> list:
    """GET of each key: one MGET on one server; on a cluster, whose MGET takes one slot only,
    redis-py's MGET split by slot (one round trip per shard)."""
    if not keys:
        return []
    return client.mget_nonatomic(keys) if is_cluster_client(client) else client.mget(keys)


def unreplicated(client, nodes: list, timeout_ms: int = REPLICA_WAIT_MS) -> list[str]:
    """The names of the cluster nodes among `nodes` (primaries just written to) whose replica
    has not confirmed the writes so far within timeout_ms (WAIT 1). A primary with no replica
    connected at all does not hold the fleet up: it counts as confirmed (degraded: a failover of
    that shard can lose its last writes; `tokenfleet status` shows the replica's health)."""
    late = []
    for node in nodes:
        if int(client.execute_command("WAIT", 1, timeout_ms, target_nodes=node)) >= 1:
            continue
        replication = client.execute_command("INFO", "replication", target_nodes=node)
        if int(replication.get("connected_slaves", 0)) > 0:
            late.append(node.name)
    return late


async def unreplicated_async(client, nodes: list, timeout_ms: int = REPLICA_WAIT_MS) -> list[str]:
    """unreplicated() for an asyncio cluster client (the nodes waited on together)."""

    async def late(node) -> bool:
        if int(await client.execute_command("WAIT", 1, timeout_ms, target_nodes=node)) >= 1:
            return False
        replication = await client.execute_command("INFO", "replication", target_nodes=node)
        return int(replication.get("connected_slaves", 0)) > 0

    flags = await asyncio.gather(*(late(node) for node in nodes))
    return [node.name for node, is_late in zip(nodes, flags, strict=True) if is_late]


def redis_away(exc: BaseException) -> bool:
    """Whether exc says Redis is away for now, so the call is tried again later rather than
    treated as a bug: unreachable or timed out, a cluster failing over (ClusterDownError,
    TryAgain, MOVED in the middle of a promotion: ClusterError), or redis-py itself slipping on a
    connection another thread or task just closed during a failover (an AttributeError raised
    inside the redis package: its writer None)."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError)):
        return True
    if not isinstance(exc, AttributeError):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}redis{os.sep}" in tb.tb_frame.f_code.co_filename


def refresh_cluster_view(client) -> None:
    """Have a (sync) cluster client read the slots again after a failed call. A pipeline's
    ConnectionError does not make redis-py do it: after a primary died and its replica took
    over, the scheduler and its publisher kept sending to the dead address. No-op on one server
    and while no node answers (the next failure tries again)."""
    manager = getattr(client, "nodes_manager", None)
    if manager is None or asyncio.iscoroutinefunction(manager.initialize):
        return
    try:
        manager.initialize()
    except Exception as exc:  # noqa: BLE001 - any failure here is the same "not yet"
        if not redis_away(exc) and not isinstance(exc, redis.RedisError):
            raise
