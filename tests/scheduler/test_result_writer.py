"""The result writer: a thread that writes each step's records while the next step runs, in
order, through Redis outages, and says which requests a successor took."""

from __future__ import annotations

import threading

import redis

from protocol.keys import Keys
from protocol.messages import pack_list_chunk, unpack_list_chunks
from service.result_store import ResultStore, ResultUpdate
from service.result_writer import ResultWriter

STREAM = Keys().request_stream("m", "interactive")


def _step_update(req_id: str, seq: int, token_id: int) -> ResultUpdate:
    return ResultUpdate(req_id, STREAM, {"seq": seq}, appends={"token_ids": pack_list_chunk([token_id]),
                                                                "text": f"<{seq}>"})


def _writer(client: redis.Redis, owner: str = "s1") -> tuple[ResultWriter, list[str]]:
    threads: list[str] = []

    def build(step: list[tuple[str, int, int]], now: float) -> list[ResultUpdate]:
        threads.append(threading.current_thread().name)
        return [_step_update(*item) for item in step]

    client.xgroup_create(STREAM, "schedulers", id="0", mkstream=True)
    return ResultWriter(ResultStore(client, Keys(), owner, ttl_s=60), owner, build), threads


def test_steps_and_updates_are_written_in_submission_order_by_the_writer_thread(redis_server) -> None:
    client = redis_server.client()
    writer, threads = _writer(client)
    for seq in range(1, 201):
        if seq % 2:
            writer.submit_step([("r1", seq, seq)], now=0.0)
        else:
            writer.submit([_step_update("r1", seq, seq)])
    assert writer.drain(timeout_s=30)
    record = client.hgetall(Keys().result("r1"))
    assert unpack_list_chunks(record[b"token_ids"]) == list(range(1, 201))
    assert record[b"text"].decode() == "".join(f"<{seq}>" for seq in range(1, 201))
    assert threads and set(threads) == {"result-writer"}  # never on the caller's thread
    writer.close()


def test_a_write_during_a_redis_outage_lands_once_when_redis_is_back(redis_server) -> None:
    client = redis_server.client()
    writer, _ = _writer(client)
    writer.submit_step([("r1", 1, 11)], now=0.0)
    assert writer.drain(timeout_s=30)
    redis_server.stop()
    writer.submit_step([("r1", 2, 12)], now=0.0)
    writer.submit([_step_update("r1", 3, 13)])
    assert not writer.drain(timeout_s=1.0)  # held, not dropped
    assert isinstance(writer.error, redis.ConnectionError)
    redis_server.start()  # same port, its append-only file kept the first write
    assert writer.drain(timeout_s=30)
    assert writer.error is None
    assert unpack_list_chunks(client.hget(Keys().result("r1"), "token_ids")) == [11, 12, 13]
    writer.close()


def test_requests_a_successor_owns_are_reported_and_not_written(redis_server) -> None:
    client = redis_server.client()
    writer, _ = _writer(client)
    client.hset(Keys().result("taken"), mapping={"owner": "s2", "seq": 4})
    writer.submit_step([("mine", 1, 1), ("taken", 5, 5)], now=0.0)
    assert writer.drain(timeout_s=30)
    assert writer.take_lost() == ["taken"]
    assert writer.take_lost() == []  # each reported once
    taken = Keys().result("taken")
    assert client.hget(taken, "seq") == b"4" and not client.hexists(taken, "token_ids")
    assert client.hget(Keys().result("mine"), "seq") == b"1"
    writer.close()
