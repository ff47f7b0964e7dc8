"""Every Redis key tokenfleet uses, in one place. The prefix (default "tf:") is configurable.

| key                                   | type          | written by              | read by               |
| ------------------------------------- | ------------- | ----------------------- | --------------------- |
| {p}req:{P}:{model}:{interactive|batch} | stream       | gateway, batch ingester | schedulers (group)    |
| {p}req:{P}:{model}:{kind}:t:{tenant}  | stream        | gateway, batch ingester | schedulers (group)    |
| {p}req:{P}:{model}:interactive:r:{s}  | stream        | gateway (routed)        | that scheduler, peers |
| {p}routed:{model}                     | set           | scheduler               | schedulers, gateway   |
| {p}prefixes:{scheduler_id}            | string + TTL  | scheduler (heartbeat)   | gateway (routing)     |
| {p}tenants:{model}                    | set           | gateway, batch ingester | schedulers, gateway   |
| {p}tenant:{tenant}:leases             | zset          | gateway                 | gateway, schedulers   |
| {p}apikeys, {p}tenant:{tenant}        | hash, hash    | operators (CLI)         | gateway               |
| {p}ev:{P}:{req_id}                    | pub/sub       | scheduler               | gateway               |
| {p}res:{P}:{req_id}                   | hash with TTL | scheduler               | gateway, a successor  |
| {p}idem:{P}:{digest}                  | string + TTL  | gateway                 | gateway               |
| {p}resp:{P}:{req_id}                  | hash with TTL | gateway (/v1/responses) | gateway               |
| {p}cancel                             | pub/sub       | gateway                 | schedulers            |
| {p}cancelled:{P}:{req_id}             | string + TTL  | gateway                 | schedulers            |
| {p}registry:{fleet}:{kind}            | zset          | schedulers, gateways    | gateway, status, etc. |
| {p}sched:{scheduler_id}               | hash with TTL | scheduler (heartbeat)   | gateway, metrics      |
| {p}metrics:{scheduler_id}             | string + TTL  | scheduler (heartbeat)   | gateway /metrics      |
| {p}gw:{gateway_id}                    | hash with TTL | gateway (heartbeat)     | status (CLI, page)    |
| {p}drain:{scheduler_id}               | string + TTL  | autoscaler              | that scheduler        |
| {p}replicas:{model}                   | hash          | autoscaler              | status, metrics       |
| {p}dead                               | stream        | scheduler               | operators             |
| {p}batch:in                           | stream        | any Redis client        | batch ingesters       |
| {p}batch:{P}:{job}                    | hash          | batch ingesters         | clients, CLI, gateway |
| {p}batch:{P}:{job}:out                | stream        | batch ingesters         | clients, CLI, gateway |
| {p}batch:{P}:{job}:lines, :staging    | list          | batch ingesters         | batch ingesters       |
| {p}batch:{P}:{job}:written            | bitmap        | batch ingesters         | batch ingesters       |
| {p}batch:done (:{P} on a cluster)     | stream        | scheduler               | batch ingesters       |
| {p}batch:jobs, {p}batch:active        | zset, set     | batch ingesters         | gateway, ingesters    |
| {p}batch:entry:{entry_id}             | string        | batch ingesters         | clients               |
| {p}file:{file_id}, {p}files           | hash, zset    | gateway (/v1/files)     | gateway, ingesters    |

{P} is a request's partition, a literal Redis Cluster hash tag `{p<N>}`: every key of one request
(record, events channel, cancel flag, Idempotency-Key, and the stream entry that queues it)
hashes to one slot, so the scripts that touch them together run on one shard. N comes from the
request id (crc32 over `partitions`): 1 on one server (every tag is {p0}), 16 on a cluster
(shared/redis_client.py), several per shard so that slots can move. The tag stands right after
the key's kind, before any name, so it is always the key's first `{...}` (a model name with
braces in it cannot move a key to another slot). A request with an Idempotency-Key gets an id in
that key's partition (`request_id`).

The processes are found through the registries `{p}registry:{fleet}:schedulers` and
`:gateways` (protocol/registry.py), never by scanning the keyspace: no key name here is a
pattern to match.

Request ids are made by the server (never client text), so they are safe inside keys; a job id
a client chooses is checked against JOB_ID_PATTERN before it becomes part of a key.
"""

from __future__ import annotations

import hashlib
import re
import uuid
import zlib
from dataclasses import dataclass

from shared.redis_client import partitions_for

CONSUMER_GROUP = "schedulers"
INGESTER_GROUP = "ingesters"  # the batch ingesters' group on tf:batch:in and tf:batch:done
JOB_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # a tenant's name becomes part of keys
REQUEST_KINDS = ("interactive", "batch")  # read in this order: interactive first
_TAG = re.compile(r"\{p(\d+)\}")


@dataclass(frozen=True)
class RequestStreamName:
    """What a request stream's name says (Keys.parse_request_stream)."""
    partition: int
    model: str
    kind: str
    tenant: str | None = None
    replica: str | None = None  # a scheduler's own stream


@dataclass(frozen=True)
class Keys:
    prefix: str = "tf:"
    partitions: int = 1  # every process of one fleet uses the same (shared.redis_client.partitions_for)

    # -- partitions ---------------------------------------------------------------------

    def partition(self, name: str | bytes) -> int:
        """The partition of a request id (or of an Idempotency-Key's digest, or a batch job's id).
        A batch item's id, `<job>.<line>.<choice>`, is in its job's: crc32 of what precedes its
        first dot (a job's keys, items and streams share one slot)."""
        raw = name if isinstance(name, bytes) else name.encode()
        return zlib.crc32(raw.partition(b".")[0]) % self.partitions

    @staticmethod
    def tag(partition: int) -> str:
        return f"{{p{partition}}}"

    @staticmethod
    def partition_of_key(key: str | bytes) -> int:
        """The partition a key's hash tag names (0 for a key without one)."""
        match = _TAG.search(key.decode() if isinstance(key, bytes) else key)
        return int(match.group(1)) if match else 0

    def request_id(self, same_partition_as: str | None = None) -> str:
        """A new request id (server-made, so safe inside keys); with a key, one in that key's
        partition (a request and its Idempotency-Key are written by one script, on one slot)."""
        if same_partition_as is None or self.partitions == 1:
            return uuid.uuid4().hex
        wanted = self.partition_of_key(same_partition_as)
        while True:  # (about `partitions` tries, each a microsecond)
            req_id = uuid.uuid4().hex
            if self.partition(req_id) == wanted:
                return req_id

    def _of(self, kind: str, req_id: str) -> str:
        return f"{self.prefix}{kind}:{self.tag(self.partition(req_id))}:{req_id}"

    # -- keys ---------------------------------------------------------------------------

    def idempotency(self, digest: str) -> str:
        """An Idempotency-Key's record, by idempotency_digest (the gateway alone uses it)."""
        return self._of("idem", digest)

    def idempotency_for(self, api_key: str | None, key: str) -> str:
        """A client's Idempotency-Key, scoped to its API key (so two clients never collide)."""
        return self.idempotency(hashlib.sha256(f"{api_key or ''}\0{key}".encode()).hexdigest())

    def request_stream(self, model: str, kind: str, tenant: str | None = None, partition: int = 0) -> str:
        """A tenant's requests queue in a stream of their own, so that a scheduler can read
        every tenant's next request however deep another tenant's backlog is (a stream's
        consumer group hands out entries in order only). No tenant: the model's plain stream.
        One stream per partition: a request goes to its own partition's (`stream_for`)."""
        if kind not in REQUEST_KINDS:
            raise ValueError(f"request kind {kind!r} is not one of {REQUEST_KINDS}")
        base = f"{self.prefix}req:{self.tag(partition)}:{model}:{kind}"
        return base if tenant is None else f"{base}:t:{tenant}"

    def request_streams(self, model: str, kind: str, tenant: str | None = None) -> list[str]:
        """The stream of every partition, in partition order (what schedulers read)."""
        return [self.request_stream(model, kind, tenant, p) for p in range(self.partitions)]

    def stream_for(self, req_id: str, model: str, kind: str, tenant: str | None = None) -> str:
        """The stream a request is queued in: its partition's."""
        return self.request_stream(model, kind, tenant, self.partition(req_id))

    def replica_stream(self, model: str, scheduler_id: str, partition: int = 0) -> str:
        """One scheduler's own stream: requests the gateway routed to it for the prefixes it
        holds (gateway/fleet/routing.py). It reads this one first; a peer takes what waited too long
        there, and everything once it is dead or draining (service/replica_streams.py). Routing
        runs on one server only (partition 0): its submit checks the replica's heartbeat in the
        same script, which a cluster cannot do in one slot."""
        return f"{self.request_stream(model, 'interactive', None, partition)}:r:{scheduler_id}"

    def parse_request_stream(self, key: str) -> RequestStreamName | None:
        """The parts of a request stream's name (None: not one)."""
        head = f"{self.prefix}req:"
        if not key.startswith(head):
            return None
        tag, _, rest = key[len(head):].partition(":")
        match = _TAG.fullmatch(tag)
        if match is None:
            return None
        base, mark, owner = rest, "", None
        for mark_text in (":t:", ":r:"):
            left, found, right = rest.partition(mark_text)
            if found:
                base, mark, owner = left, mark_text, right
                break
        model, _, kind = base.rpartition(":")
        if not model or kind not in REQUEST_KINDS:
            return None
        return RequestStreamName(int(match.group(1)), model, kind, owner if mark == ":t:" else None,
                                 owner if mark == ":r:" else None)

    def replica_streams(self, model: str) -> str:
        """The ids of the model's schedulers that have an own stream (live or not yet taken over)."""
        return f"{self.prefix}routed:{model}"

    def prefix_summary(self, scheduler_id: str) -> str:
        """What a scheduler's KV cache holds: the first bytes of the hashes of its cached chains'
        first blocks, concatenated (service/prefix_summary.py); renewed with the heartbeat."""
        return f"{self.prefix}prefixes:{scheduler_id}"

    def loras(self, model: str) -> str:
        """The LoRA adapters served on the model: adapter name -> its record (protocol/lora_registry.py)."""
        return f"{self.prefix}loras:{model}"

    def tenants(self, model: str) -> str:
        """Every tenant that has queued requests for the model (the streams schedulers read)."""
        return f"{self.prefix}tenants:{model}"

    @property
    def api_keys(self) -> str:
        """API keys kept in Redis: SHA-256 hex digest of the key -> tenant."""
        return f"{self.prefix}apikeys"

    def tenant(self, tenant: str) -> str:
        """A tenant's limits, kept in Redis (fields of gateway.tenants.directory.TenantLimits)."""
        return f"{self.prefix}tenant:{tenant}"

    def tenant_leases(self, tenant: str) -> str:
        """The tenant's requests in flight: member req_id, score the lease's expiry (unix s)."""
        return f"{self.prefix}tenant:{tenant}:leases"

    def events(self, req_id: str) -> str:
        return self._of("ev", req_id)

    def result(self, req_id: str) -> str:
        return self._of("res", req_id)

    def response(self, req_id: str) -> str:
        """A stored Responses-API response: what was asked (its input, tools, format...), beside
        the request's own record in the same partition; its output is read from that record."""
        return self._of("resp", req_id)

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}cancel"

    def cancelled(self, req_id: str) -> str:
        return self._of("cancelled", req_id)

    def scheduler(self, scheduler_id: str) -> str:
        return f"{self.prefix}sched:{scheduler_id}"

    def scheduler_metrics(self, scheduler_id: str) -> str:
        """The scheduler's engine metrics in Prometheus text format, renewed at each heartbeat."""
        return f"{self.prefix}metrics:{scheduler_id}"

    def gateway(self, gateway_id: str) -> str:
        return f"{self.prefix}gw:{gateway_id}"

    def registry(self, kind: str) -> str:
        """The live processes of one kind (protocol/registry.py): member its id, score when its
        heartbeat lapses (unix s, the server's clock). Every registry has the hash tag {fleet}:
        one slot on a cluster, read by one script."""
        return f"{self.prefix}registry:{{fleet}}:{kind}"

    def drain(self, scheduler_id: str) -> str:
        """Set (value: a deadline, unix seconds) to ask one scheduler to drain: it reads no new
        entries, finishes what it runs (what is left at the deadline is taken over), then exits."""
        return f"{self.prefix}drain:{scheduler_id}"

    def replicas(self, model: str) -> str:
        """The autoscaler's view of one model: desired, actual, starting, draining, min, max,
        unplaced (placements that timed out), last_event, last_event_at, updated_at."""
        return f"{self.prefix}replicas:{model}"

    @property
    def dead(self) -> str:
        return f"{self.prefix}dead"

    # -- batch jobs ---------------------------------------------------------------------

    @property
    def batch_in(self) -> str:
        return f"{self.prefix}batch:in"

    @property
    def batch_done(self) -> str:
        """Notices of batch items that reached a terminal state (written with that state)."""
        return f"{self.prefix}batch:done"

    def batch_done_of(self, partition: int) -> str:
        """The notice stream a partition's result writes append to (in the same script as the
        record, so on its slot): the one tf:batch:done on one server, one per partition on a
        cluster (`batch_done_streams`)."""
        return self.batch_done if self.partitions == 1 else f"{self.batch_done}:{self.tag(partition)}"

    @property
    def batch_done_streams(self) -> list[str]:
        return [self.batch_done_of(p) for p in range(self.partitions)]

    @property
    def batch_jobs(self) -> str:
        return f"{self.prefix}batch:jobs"

    @property
    def batch_active(self) -> str:
        return f"{self.prefix}batch:active"

    def batch_job(self, job_id: str) -> str:
        """A job's hash; its other keys add a suffix. In the job's partition, with its items."""
        return f"{self.prefix}batch:{self.tag(self.partition(job_id))}:{job_id}"

    def batch_job_raw(self, job_id: bytes) -> bytes:
        """batch_job() of an id as stored (a member that is not text still names its key)."""
        return f"{self.prefix}batch:{self.tag(self.partition(job_id))}:".encode() + job_id

    def batch_out(self, job_id: str) -> str:
        return f"{self.batch_job(job_id)}:out"

    def batch_lines(self, job_id: str) -> str:
        return f"{self.batch_job(job_id)}:lines"

    def batch_staging(self, job_id: str) -> str:
        return f"{self.batch_job(job_id)}:staging"

    def batch_written(self, job_id: str) -> str:
        return f"{self.batch_job(job_id)}:written"

    def batch_entry(self, entry_id: str) -> str:
        return f"{self.prefix}batch:entry:{entry_id}"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}"

    @property
    def files(self) -> str:
        return f"{self.prefix}files"


def keys_for(redis_url: str, prefix: str = "tf:") -> Keys:
    """The keys of the fleet on this Redis: its partitions follow from the URL (one server: 1;
    a cluster: shared.redis_client.CLUSTER_PARTITIONS), the same in every process."""
    return Keys(prefix, partitions_for(redis_url))
