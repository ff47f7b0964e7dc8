"""Routing by prefix: the choice (pure), and the submit script that queues into a replica's own
stream only while that replica lives and is not draining (real Redis)."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from gateway.fleet.routing import PrefixRouter, ReplicaView, choose_replica
from gateway.serving.records import ResultRecord
from gateway.serving.store import GatewayKeys, RequestStore, Submission
from protocol.messages import RequestMessage
from protocol.prefix_hash import block_hashes, summary_hash
from shared.sampling import SamplingParams

SYSTEM = list(range(1000, 1000 + 16 * 8))  # 8 blocks of 16
TEMPLATE = SYSTEM[:16]  # the first block: every replica holds it (a chat template's head)


def _holding(scheduler_id: str, tokens: list[int], **load) -> ReplicaView:
    prefixes = frozenset(summary_hash(h) for h in block_hashes(tokens, 16))
    return ReplicaView(scheduler_id, 16, 64, prefixes, max_num_seqs=8, **load)


def test_the_replica_holding_the_longest_prefix_is_chosen() -> None:
    prompt = [*SYSTEM, 7, 8, 9]
    replicas = [_holding("a", TEMPLATE), _holding("b", SYSTEM), _holding("c", SYSTEM[:64])]
    route = choose_replica(prompt, replicas)
    assert (route.scheduler_id, route.decision, route.matched_tokens) == ("b", "routed", 128)


def test_host_tier_blocks_count_below_gpu_blocks_but_beyond_a_miss() -> None:
    """A replica holding the whole prefix in its host KV tier (its first 2 blocks on the GPU) beats
    one holding half of it on the GPU, and loses to one holding all of it on the GPU."""
    prompt = [*SYSTEM, 7, 8, 9]
    hashes = [summary_hash(h) for h in block_hashes(SYSTEM, 16)]
    in_host = ReplicaView("host", 16, 64, frozenset(hashes[:2]), max_num_seqs=8,
                          host_prefixes=frozenset(hashes[2:]))
    route = choose_replica(prompt, [_holding("half", SYSTEM[:64]), in_host])
    assert (route.scheduler_id, route.matched_tokens) == ("host", (2 + 0.5 * 6) * 16)
    assert choose_replica(prompt, [_holding("gpu", SYSTEM), in_host]).scheduler_id == "gpu"


def test_no_match_or_a_match_every_replica_has_goes_to_the_shared_stream() -> None:
    assert choose_replica([5] * 200, [_holding("a", SYSTEM), _holding("b", SYSTEM)]).decision == "no_match"
    both = [_holding("a", TEMPLATE), _holding("b", TEMPLATE)]
    assert choose_replica([*SYSTEM, 1], both).scheduler_id is None
    assert choose_replica([*SYSTEM, 1], [_holding("a", SYSTEM)]).decision == "single"


def test_a_long_prefix_every_replica_holds_goes_to_one_of_them_always_the_same() -> None:
    """Chats that reached both replicas before either published the prefix left two copies: from
    then on one replica gets them all, whatever the order or loads, and the other copy ages out."""
    prompt = [*SYSTEM, 1]
    picks = {choose_replica(prompt, replicas).scheduler_id for replicas in (
        [_holding("a", SYSTEM), _holding("b", SYSTEM)],
        [_holding("b", SYSTEM, num_running=3), _holding("a", SYSTEM)],
        [_holding("a", SYSTEM, num_running=5), _holding("b", SYSTEM, num_running=1)])}
    assert len(picks) == 1 and picks <= {"a", "b"}
    chosen = picks.pop()
    other = "b" if chosen == "a" else "a"
    full = [_holding(chosen, SYSTEM, num_running=8), _holding(other, SYSTEM)]
    assert choose_replica(prompt, full).scheduler_id == other  # no free slot: the other copy
    # Other prefixes spread over the replicas.
    systems = [[p, *SYSTEM[1:]] for p in range(20)]
    spread = {choose_replica([*s, 1], [_holding("a", s), _holding("b", s)]).scheduler_id for s in systems}
    assert spread == {"a", "b"}


def test_the_last_token_is_never_counted_as_a_hit() -> None:
    """The block manager computes a prompt's last token always: a prompt of exactly the cached
    blocks matches one block less, as the scheduler would find it."""
    route = choose_replica(SYSTEM, [_holding("a", SYSTEM), _holding("b", [])])
    assert route.matched_tokens == len(SYSTEM) - 16


def test_load_is_weighed_and_an_overloaded_or_draining_holder_gets_nothing() -> None:
    prompt = [*SYSTEM, 1]
    # A little less matched on an idle replica beats a full match on a nearly full one.
    near = [_holding("full", SYSTEM, num_running=7), _holding("idle", SYSTEM[:112]), _holding("x", [])]
    assert choose_replica(prompt, near).scheduler_id == "idle"
    overloaded = [_holding("a", SYSTEM, num_running=6, backlog=2), _holding("b", [])]
    assert choose_replica(prompt, overloaded).decision == "overloaded"
    draining = [_holding("a", SYSTEM, draining=True), _holding("b", []), _holding("c", [])]
    assert choose_replica(prompt, draining).scheduler_id is None


def test_the_router_counts_what_it_routed_until_the_next_read_of_the_fleet() -> None:
    router = PrefixRouter()
    router.update("m", [_holding("a", SYSTEM, num_running=5), _holding("b", [])])
    routes = [router.route("m", [*SYSTEM, i]) for i in range(5)]
    assert [r.scheduler_id for r in routes] == ["a", "a", "a", None, None]  # 8 slots: then overloaded


def _submission(req_id: str) -> Submission:
    return Submission(req_id, RequestMessage.make(req_id, "m", [*SYSTEM, 1], SamplingParams(max_tokens=2)),
                      "completion")


@pytest.mark.asyncio
async def test_a_routed_request_is_queued_in_the_replicas_stream_only_while_it_lives_undrained(
        redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    keys = GatewayKeys()
    store = RequestStore(client, keys, result_ttl_s=60, cancel_ttl_s=60, idempotency_ttl_s=60)
    store.router = PrefixRouter()
    own, shared = keys.replica_stream("m", "a"), keys.request_stream("m", "interactive")
    try:
        await client.sadd(keys.replica_streams("m"), "a")
        await client.hset(keys.scheduler("a"), mapping={"model": "m"})
        store.router.update("m", [_holding("a", SYSTEM), _holding("b", [])])
        await store.submit([_submission("1" * 32)])
        assert (await client.xlen(own), await client.xlen(shared)) == (1, 0)
        assert await store.queue_depth("m") == 1  # a replica's own stream counts in the queue
        await client.set(keys.drain("a"), time.time() + 60)  # drain asked: not routed there any more
        await store.submit([_submission("2" * 32)])
        await client.delete(keys.drain("a"), keys.scheduler("a"))  # dead: not routed there either
        await store.submit([_submission("3" * 32)])
        assert (await client.xlen(own), await client.xlen(shared)) == (1, 2)
        # A cancel before any scheduler took it removes it from the stream it is in.
        record = ResultRecord.parse("1" * 32, await client.hgetall(keys.result("1" * 32)))
        assert await store.finish_unclaimed(record, "cancelled", "cancelled")
        assert await client.xlen(own) == 0
    finally:
        await client.aclose()


def test_a_request_on_an_adapter_goes_to_the_least_loaded_replica_holding_it() -> None:
    prompt = list(range(100))
    plain = _holding("plain", prompt)  # holds the prompt's prefix (on the base), not the adapter
    busy = ReplicaView("busy", 16, 64, frozenset(), num_running=6, max_num_seqs=8, loras=frozenset({"sql"}))
    idle = ReplicaView("idle", 16, 64, frozenset(), num_running=1, max_num_seqs=8, loras=frozenset({"sql"}))
    assert choose_replica(prompt, [plain, busy, idle], lora_name="sql").scheduler_id == "idle"
    assert choose_replica(prompt, [plain, busy], lora_name="sql").decision == "lora"
    # Nobody holds it, or everybody: whichever replica has room pulls it from the shared stream.
    assert choose_replica(prompt, [plain, busy, idle], lora_name="chat").scheduler_id is None
    assert choose_replica(prompt, [busy, idle], lora_name="sql").scheduler_id is None
    full = ReplicaView("full", 16, 64, frozenset(), num_running=8, max_num_seqs=8, loras=frozenset({"sql"}))
    assert choose_replica(prompt, [plain, full], lora_name="sql").decision == "overloaded"


def test_a_heartbeat_names_the_adapters_a_replica_holds_and_its_largest_rank() -> None:
    from gateway.fleet.tracker import SchedulerInfo

    beat = {b"model": b"m", b"loras_loaded": b'["sql", "chat"]', b"max_lora_rank": b"16"}
    info = SchedulerInfo.parse("s1", beat)
    assert (info.loras_loaded, info.max_lora_rank) == (frozenset({"sql", "chat"}), 16)
    plain = SchedulerInfo.parse("s2", {b"model": b"m"})  # an engine without adapters
    assert (plain.loras_loaded, plain.max_lora_rank) == (frozenset(), 0)
