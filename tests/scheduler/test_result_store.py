"""The tf:res write: per-step chunks appended once, even when a flush is sent again."""

from __future__ import annotations

import redis

from protocol.keys import Keys
from protocol.messages import pack_list_chunk, unpack_list_chunks
from service.result_store import ResultStore, ResultUpdate


def test_appended_chunks_land_once_per_seq_even_when_a_flush_is_resent(redis_server) -> None:
    client = redis.Redis.from_url(redis_server.url)
    store = ResultStore(client, Keys(), "s1", ttl_s=60)
    client.xgroup_create(Keys().request_stream("m", "interactive"), "schedulers", id="0", mkstream=True)

    def step(seq: int, ids: list[int], text: str) -> ResultUpdate:
        return ResultUpdate("r1", Keys().request_stream("m", "interactive"), {"seq": seq},
                            appends={"token_ids": pack_list_chunk(ids), "text": text,
                                     "offsets": pack_list_chunk([[seq, seq]])})

    assert store.write([step(1, [5, 6], "ab")]) == [True]
    assert store.write([step(2, [7], "c"), step(2, [7], "c")]) == [True, True]  # the second is a resend
    assert store.write([step(2, [7], "c")]) == [True]  # and once more, after a "lost" reply
    record = client.hgetall(Keys().result("r1"))
    assert unpack_list_chunks(record[b"token_ids"]) == [5, 6, 7]
    assert record[b"text"] == b"abc"
    assert unpack_list_chunks(record[b"offsets"]) == [[1, 1], [2, 2]]
    assert record[b"seq"] == b"2" and record[b"owner"] == b"s1"
    # A whole list set at once (a batch item's end, the fake scheduler) is one chunk, and a later
    # append extends it.
    stream = Keys().request_stream("m", "interactive")
    store.write([ResultUpdate("r2", stream, {"seq": 1, "token_ids": pack_list_chunk([1, 2])})])
    store.write([ResultUpdate("r2", stream, {"seq": 2}, appends={"token_ids": pack_list_chunk([3])})])
    assert unpack_list_chunks(client.hget(Keys().result("r2"), "token_ids")) == [1, 2, 3]
