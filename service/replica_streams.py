"""A scheduler's own stream, and its peers': routed work is never stranded.

The gateway routes a chat to the scheduler whose KV cache holds its prefix by queueing it in
that scheduler's own stream, `tf:req:{model}:interactive:r:{id}` (gateway/fleet/routing.py). The
scheduler reads its own stream before the shared one. Every scheduler also watches its peers'
streams (the ids in `tf:routed:{model}`), once per maintenance:

- a peer that is alive: an idle scheduler (free slots, nothing waiting) reads the peer's
  entries that have waited unread longer than `steal_after_s` (by Redis's clock: an entry's id
  is its time), so an overloaded replica's queue drains into idle ones;
- a peer that is dead (its heartbeat expired) or draining: every unread entry, as far as there
  is room; its pending entries are taken over after the lease like any others (the service's
  XAUTOCLAIM covers the peer streams too). A peer's stream is deleted once it is empty and the
  peer has looked dead for `forget_after_s` (a heartbeat also lapses while one long step runs on
  a busy machine, and a new scheduler lists itself just before its first heartbeat).

The gateway's submit script queues into an own stream only while the owner's heartbeat exists
and no drain was asked for, in the same atomic step, so nothing lands in a stream nobody
reads after its takeover. Entries taken are counted by where they came from: routed (own
stream), stolen (a peer's), fallback (the shared and tenant streams).

On a Redis Cluster nothing is routed (that check cannot share a slot with the request's keys:
protocol/keys.py), so a scheduler lists no own stream and watches no peers there.
"""

from __future__ import annotations

import time

import redis
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from protocol import lua
from protocol.abandoned import Entry, claim_abandoned
from protocol.keys import CONSUMER_GROUP, Keys
from shared.redis_client import is_cluster_client

SOURCES = ("routed", "stolen", "fallback")

_FORGET = lua.Script("forget_replica")  # (a dead peer's stream, once empty: protocol/lua/forget_replica.lua)


class ReplicaStreams:
    def __init__(self, client: redis.Redis, keys: Keys, model: str, scheduler_id: str, *,
                 steal_after_s: float, forget_after_s: float = 30.0) -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self.scheduler_id = scheduler_id
        self.steal_after_s = steal_after_s
        self.forget_after_s = forget_after_s
        self._dead_since: dict[str, float] = {}  # peer id -> when its heartbeat was first found gone
        self.own = keys.replica_stream(model, scheduler_id)
        self.peers: dict[str, str] = {}  # peer id -> its stream, as last read from tf:routed:{model}
        self.counts = dict.fromkeys(SOURCES, 0)
        self.is_enabled = not is_cluster_client(client)  # (no routing on a cluster)

    def register(self) -> None:
        """Listed, so that peers watch the own stream (its group is made with the others)."""
        if self.is_enabled:
            self.client.sadd(self.keys.replica_streams(self.model), self.scheduler_id)

    def peer_streams(self) -> list[str]:
        return list(self.peers.values())

    def count(self, stream: str) -> None:
        """One entry started from `stream`."""
        if stream == self.own:
            self.counts["routed"] += 1
        elif stream in self.peers.values():
            self.counts["stolen"] += 1
        else:
            self.counts["fallback"] += 1

    def heartbeat_fields(self) -> dict[str, int]:
        return {f"entries_{source}": n for source, n in self.counts.items()}

    # -- peers --------------------------------------------------------------------------

    def find_work(self, room: int, *, idle: bool) -> list[tuple[str, str, dict]]:
        """Entries (stream, id, fields) read from peers' streams, at most `room` of them: every
        unread one of a dead or draining peer, and, when `idle`, those a live peer left unread
        longer than `steal_after_s`."""
        if not self.is_enabled:
            return []
        ids = sorted(m.decode() for m in self.client.smembers(self.keys.replica_streams(self.model)))
        self.peers = {p: self.keys.replica_stream(self.model, p) for p in ids if p != self.scheduler_id}
        if room <= 0 or not self.peers:
            return []
        pipe = self.client.pipeline(transaction=False)
        for peer in self.peers:
            pipe.hget(self.keys.scheduler(peer), "draining")
            pipe.exists(self.keys.drain(peer))
        replies = pipe.execute()
        found: list[tuple[str, str, dict]] = []
        live: list[str] = []
        for (peer, stream), draining, drain_asked in zip(self.peers.items(), replies[::2], replies[1::2],
                                                         strict=True):
            if draining is not None:
                self._dead_since.pop(peer, None)
                if draining != b"1" and not drain_asked:
                    live.append(stream)
                    continue
            got = self._read(stream, room - len(found))  # dead or draining: all it left unread
            found += got
            dead_since = self._dead_since.setdefault(peer, time.monotonic()) if draining is None else None
            if dead_since is not None and not got and time.monotonic() - dead_since >= self.forget_after_s:
                forget = [self.keys.scheduler(peer), stream, self.keys.replica_streams(self.model)]
                _FORGET.run(self.client, forget, [peer])
            if len(found) >= room:
                return found
        if idle and live:
            for stream, num_old in self._num_waited_too_long(live, room - len(found)).items():
                found += self._read(stream, min(num_old, room - len(found)))
                if len(found) >= room:
                    break
        return found

    def _num_waited_too_long(self, streams: list[str], limit: int) -> dict[str, int]:
        """stream -> how many of its unread entries are older than steal_after_s (at most limit)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        for stream in streams:
            pipe.execute_command("XINFO", "GROUPS", stream)
        (now_s, now_us), *infos = pipe.execute(raise_on_error=False)
        cutoff_ms = int(now_s) * 1000 + int(now_us) // 1000 - int(self.steal_after_s * 1000)
        pipe = self.client.pipeline(transaction=False)
        asked = []
        for stream, groups in zip(streams, infos, strict=True):
            last = _last_delivered(groups)
            if last is not None:
                pipe.xrange(stream, min=f"({last}", max=str(cutoff_ms), count=limit)
                asked.append(stream)
        if not asked:
            return {}
        old = {stream: len(entries) for stream, entries in zip(asked, pipe.execute(), strict=True)}
        return {stream: n for stream, n in old.items() if n}

    def claim_abandoned(self, stream: str, lease_ms: int, count: int) -> tuple[list[Entry], list[bytes]]:
        """protocol.abandoned.claim_abandoned, where a peer's stream may have been deleted by
        another peer meanwhile (then there is nothing to claim)."""
        try:
            return claim_abandoned(self.client, stream, CONSUMER_GROUP, self.scheduler_id, lease_ms, count)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc) and stream in self.peers.values():
                return [], []
            raise

    def _read(self, stream: str, count: int) -> list[tuple[str, str, dict]]:
        if count <= 0:
            return []
        try:
            reply = self.client.xreadgroup(CONSUMER_GROUP, self.scheduler_id, {stream: ">"}, count=count)
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                return []  # (deleted meanwhile: nothing there)
            raise
        return [(stream, entry_id.decode(), fields) for _, items in reply or [] for entry_id, fields in items]


def _last_delivered(groups) -> str | None:
    """The schedulers group's last-delivered id from an XINFO GROUPS reply (None: no such group)."""
    if isinstance(groups, Exception):
        return None
    for group in groups:
        fields = group if isinstance(group, dict) else dict(zip(group[::2], group[1::2], strict=True))
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        name = fields.get("name")
        if (name.decode() if isinstance(name, bytes) else name) == CONSUMER_GROUP:
            last = fields.get("last-delivered-id")
            return last.decode() if isinstance(last, bytes) else last
    return None


class RoutingMetrics(Collector):
    """`tokenfleet:routing_entries{source}`: entries this scheduler started, by where it read them."""

    def __init__(self, streams: ReplicaStreams, labels: list[str]) -> None:
        self.streams = streams
        self.labels = labels

    def collect(self):
        family = CounterMetricFamily("tokenfleet:routing_entries",
                                     "request entries started, by stream: routed (its own), stolen "
                                     "(a peer's), fallback (the shared ones)",
                                     labels=["model_name", "scheduler", "source"])
        for source, n in self.streams.counts.items():
            family.add_metric([*self.labels, source], n)
        yield family
