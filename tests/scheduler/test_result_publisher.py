"""The result publisher: a process of its own that turns each step's outputs into records and
events and writes them in order, through Redis outages, and says which requests a successor
took. Against a real Redis server, with the real tokenizer of a tiny model."""

from __future__ import annotations

import os
import signal

import pytest
import redis

from protocol.keys import Keys
from protocol.messages import decode_event, pack_list_chunk, unpack_list_chunks
from protocol.result_record import running_fields
from scheduler.request import FinishReason
from scheduler.scheduler import RequestOutput
from service.delivery import Delivery
from service.result_publisher import PublisherDied, ResultPublisher
from service.result_store import ResultUpdate
from shared.tokenizer import load_tokenizer

KEYS = Keys()
STREAM = KEYS.request_stream("m", "interactive")


def _publisher(redis_server, tokenizer=None, owner: str = "s1", num_processes: int = 2) -> ResultPublisher:
    redis_server.client().xgroup_create(STREAM, "schedulers", id="0", mkstream=True)
    return ResultPublisher(redis_server.url, Keys(), owner, 60, tokenizer, num_processes=num_processes)


def _out(req_id: str, *token_ids: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(req_id, list(token_ids), "", finished,
                         FinishReason.LENGTH if finished else None)


def test_steps_are_written_in_order_with_gap_free_seqs(redis_server) -> None:
    client = redis_server.client()
    publisher = _publisher(redis_server)
    publisher.start(Delivery("r1", STREAM, "1-0", 3), None)
    pubsub = client.pubsub()
    pubsub.subscribe(KEYS.events("r1"))
    for token in range(1, 201):
        publisher.submit_step([_out("r1", token, finished=token == 200)], now=0.0)
    assert publisher.drain(timeout_s=30)
    record = client.hgetall(KEYS.result("r1"))
    assert unpack_list_chunks(record[b"token_ids"]) == list(range(1, 201))
    assert record[b"seq"] == b"200" and record[b"state"] == b"completed"
    assert publisher.take_ended() == ["r1"]
    events = []
    while (message := pubsub.get_message(timeout=1.0)) is not None or len(events) < 200:
        if message is not None and message["type"] == "message":
            events.append(decode_event(message["data"]))
    assert [e.seq for e in events] == list(range(1, 201))
    assert events[-1].finish_reason == "length" and events[-1].usage["completion_tokens"] == 200
    publisher.close()


def test_text_is_made_in_the_publishers_process_from_where_an_earlier_owner_stopped(
        redis_server, tiny_chat) -> None:
    tokenizer = load_tokenizer(tiny_chat)
    client = redis_server.client()
    words = tokenizer(" the quick brown fox jumps", add_special_tokens=False).input_ids
    prompt = tokenizer("Say:", add_special_tokens=False).input_ids
    publisher = _publisher(redis_server, tokenizer)
    # Resumed after the first two tokens, whose text an earlier owner sent.
    sent = tokenizer.decode(words[:2])
    client.hset(KEYS.result("r1"), mapping={"seq": 1, "text": sent, "token_ids": pack_list_chunk(words[:2]),
                                            "offsets": pack_list_chunk([[2, len(sent)]])})
    publisher.start(Delivery("r1", STREAM, "1-0", len(prompt), seq=1, token_ids=words[:2], text=sent,
                             offsets=[[2, len(sent)]], detokenize_after=[*prompt, *words[:2]]), None)
    for token in words[2:]:
        publisher.submit_step([_out("r1", token)], now=0.0)
    assert publisher.drain(timeout_s=30)
    assert client.hget(KEYS.result("r1"), "text").decode() == sent + tokenizer.decode(words[2:])
    assert all(p.process.pid != os.getpid() for p in publisher._processes)
    publisher.close()


def test_a_record_that_lost_its_last_writes_is_written_whole_again_not_left_with_a_gap(redis_server) -> None:
    """Redis killed -9 comes back from its append-only file without its last second: the record
    misses steps its clients were sent. The next step's chunk would land after the gap; the
    publisher writes the whole record instead, and every event still goes out once, in order."""
    client = redis_server.client()
    publisher = _publisher(redis_server)
    publisher.start(Delivery("r1", STREAM, "1-0", 3), None)
    pubsub = client.pubsub()
    pubsub.subscribe(KEYS.events("r1"))

    def steps(tokens, last: int | None = None) -> None:
        for token in tokens:
            publisher.submit_step([RequestOutput("r1", [token], f"t{token} ", token == last,
                                                 FinishReason.LENGTH if token == last else None)], now=0.0)
        assert publisher.drain(timeout_s=30)

    steps(range(1, 4))
    before_the_loss = client.dump(KEYS.result("r1"))
    steps(range(4, 6))
    client.restore(KEYS.result("r1"), 0, before_the_loss, replace=True)  # steps 4 and 5 lost
    steps(range(6, 9), last=8)
    record = client.hgetall(KEYS.result("r1"))
    assert unpack_list_chunks(record[b"token_ids"]) == list(range(1, 9))
    assert record[b"text"].decode() == "".join(f"t{t} " for t in range(1, 9))
    assert unpack_list_chunks(record[b"offsets"]) == [[t, 3 * t] for t in range(1, 9)]
    assert record[b"seq"] == b"8" and record[b"state"] == b"completed"
    assert publisher.take_ended() == ["r1"]
    events = []
    while (message := pubsub.get_message(timeout=1.0)) is not None or len(events) < 8:
        if message is not None and message["type"] == "message":
            events.append(decode_event(message["data"]))
    assert [e.seq for e in events] == list(range(1, 9))
    assert "".join(e.text for e in events) == record[b"text"].decode()
    publisher.close()


def test_a_write_during_a_redis_outage_lands_once_when_redis_is_back(redis_server) -> None:
    client = redis_server.client()
    publisher = _publisher(redis_server)
    publisher.start(Delivery("r1", STREAM, "1-0", 3), None)
    publisher.submit_step([_out("r1", 11)], now=0.0)
    assert publisher.drain(timeout_s=30)
    redis_server.stop()
    publisher.submit_step([_out("r1", 12)], now=0.0)
    publisher.submit([ResultUpdate("r1", STREAM, {"model": "m"})])
    assert not publisher.drain(timeout_s=1.5)  # held, not dropped
    assert isinstance(publisher.error, redis.ConnectionError)
    redis_server.start()  # same port, its append-only file kept the first write
    assert publisher.drain(timeout_s=30)
    assert publisher.error is None
    assert unpack_list_chunks(client.hget(KEYS.result("r1"), "token_ids")) == [11, 12]
    assert client.hget(KEYS.result("r1"), "model") == b"m"
    publisher.close()


def test_requests_a_successor_owns_are_reported_and_not_written(redis_server) -> None:
    client = redis_server.client()
    publisher = _publisher(redis_server)
    client.hset(KEYS.result("taken"), mapping={"owner": "s2", "seq": 4})
    client.hset(KEYS.result("mine"), mapping={"owner": "s1"})
    publisher.start(Delivery("mine", STREAM, "1-0", 3), None)
    publisher.start(Delivery("taken", STREAM, "2-0", 3, seq=4), None)
    publisher.submit_step([_out("mine", 1), _out("taken", 5)], now=0.0)
    assert publisher.drain(timeout_s=30)
    assert publisher.take_lost() == ["taken"]
    assert publisher.take_lost() == []  # each reported once
    taken = KEYS.result("taken")
    assert client.hget(taken, "seq") == b"4" and not client.hexists(taken, "token_ids")
    assert client.hget(KEYS.result("mine"), "seq") == b"1"
    publisher.close()


def test_a_request_that_never_ran_ends_with_an_error_event_after_its_earlier_seqs(redis_server) -> None:
    client = redis_server.client()
    publisher = _publisher(redis_server)
    publisher.start(Delivery("r1", STREAM, "1-0", 3, seq=2, token_ids=[7, 8], text="ab",
                             offsets=[[1, 1], [2, 2]]), None)
    publisher.finish_unrun("r1", "expired", "expired", "it waited past its deadline")
    assert publisher.drain(timeout_s=30)
    record = client.hgetall(KEYS.result("r1"))
    assert record[b"state"] == b"expired" and record[b"seq"] == b"3"
    assert publisher.take_ended() == ["r1"]
    publisher.close()


def test_a_dead_publisher_stops_the_scheduler_instead_of_losing_its_writes_silently(redis_server) -> None:
    publisher = _publisher(redis_server)
    dead = publisher._process_of("r1").process
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(timeout=10)
    with pytest.raises(PublisherDied):
        for _ in range(100):  # (the pipe may take a few sends to notice)
            publisher.start(Delivery("r1", STREAM, "1-0", 3), None)
            publisher.take_ended()
    publisher.close()


@pytest.mark.parametrize("num_processes", [1, 3])
def test_requests_dealt_over_processes_each_keep_their_order(redis_server, num_processes: int) -> None:
    client = redis_server.client()
    publisher = _publisher(redis_server, num_processes=num_processes)
    req_ids = [f"r{i}" for i in range(12)]
    assert len({id(publisher._process_of(r)) for r in req_ids}) == num_processes  # (all take some)
    for i, req_id in enumerate(req_ids):
        publisher.start(Delivery(req_id, STREAM, f"{i + 1}-0", 3), None)
    for token in range(1, 41):
        publisher.submit_step([_out(r, token, finished=token == 40) for r in req_ids], now=0.0)
        publisher.submit([ResultUpdate(req_ids[token % 12], STREAM, {"model": f"m{token}"})])
    assert publisher.drain(timeout_s=30) and publisher.num_pending == 0
    for req_id in req_ids:
        record = client.hgetall(KEYS.result(req_id))
        assert unpack_list_chunks(record[b"token_ids"]) == list(range(1, 41))
        assert record[b"seq"] == b"40" and record[b"state"] == b"completed"
    assert sorted(publisher.take_ended()) == sorted(req_ids)
    publisher.close()


def test_an_admissions_starts_sent_together_count_one_each_and_write_their_running_fields(
        redis_server) -> None:
    client = redis_server.client()
    publisher = _publisher(redis_server, num_processes=3)
    req_ids = [f"r{i}" for i in range(12)]
    running = running_fields(model="m", prompt_tokens=3, scheduler="s1")
    publisher.start_many([(Delivery(req_id, STREAM, f"{i + 1}-0", 3), ResultUpdate(req_id, STREAM, running))
                          for i, req_id in enumerate(req_ids)])
    assert publisher.num_pending == 12  # (one message per process, twelve starts)
    assert publisher.drain(timeout_s=30) and publisher.num_pending == 0
    for req_id in req_ids:
        record = client.hgetall(KEYS.result(req_id))
        assert record[b"state"] == b"running" and record[b"scheduler"] == b"s1"
    publisher.submit_step([_out(r, 7, finished=True) for r in req_ids], now=0.0)
    assert publisher.drain(timeout_s=30) and publisher.num_pending == 0
    for req_id in req_ids:
        record = client.hgetall(KEYS.result(req_id))
        assert unpack_list_chunks(record[b"token_ids"]) == [7] and record[b"state"] == b"completed"
    assert sorted(publisher.take_ended()) == sorted(req_ids)
    publisher.close()


def test_a_first_token_is_published_before_the_rest_of_its_step(redis_server) -> None:
    """A step's events reach their subscribers only when its whole write has run; the request
    whose first token it is must not wait for the step's other requests."""
    from multiprocessing import Pipe

    from service.delivery import StepOutput
    from service.publisher_process import START, STEP, Publisher
    from service.result_store import ResultStore

    client = redis_server.client()
    client.xgroup_create(STREAM, "schedulers", id="0", mkstream=True)
    _, outbox = Pipe()
    publisher = Publisher(ResultStore(client, KEYS, "s1", 60), None, outbox, "s1")
    old = [f"old{i}" for i in range(20)]
    publisher.handle([(START, Delivery(r, STREAM, f"{i + 1}-0", 3), None) for i, r in enumerate(old)])
    publisher.handle([(STEP, [StepOutput.of(_out(r, 7)) for r in old], 0.0)])  # their first tokens
    pubsub = client.pubsub()
    pubsub.psubscribe(KEYS.events("*"))
    assert pubsub.get_message(timeout=1.0)["type"] == "psubscribe"
    step = [StepOutput.of(_out(r, 8)) for r in old] + [StepOutput.of(_out("new", 5))]
    publisher.handle([(STEP, [StepOutput.of(_out(r, 9)) for r in old[:5]], 0.0),
                      (START, Delivery("new", STREAM, "99-0", 3), None), (STEP, step, 1.0),
                      (STEP, [StepOutput.of(_out("new", 6)), StepOutput.of(_out(old[0], 10))], 2.0)])
    events = []
    while len(events) < 5 + 21 + 2 and (message := pubsub.get_message(timeout=2.0)) is not None:
        if message["type"] == "pmessage":
            events.append(decode_event(message["data"]))
    assert (events[0].req_id, events[0].seq) == ("new", 1)
    for req_id in [*old, "new"]:  # each request's own events still in order, gap-free
        seqs = [e.seq for e in events if e.req_id == req_id]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert [e.token_ids for e in events if e.req_id == "new"] == [[5], [6]]
    assert unpack_list_chunks(client.hget(KEYS.result(old[0]), "token_ids")) == [7, 9, 8, 10]


def test_a_start_of_a_request_still_live_in_the_publisher_is_logged(redis_server) -> None:
    """The engine thread never starts a request twice while its first run's writes are live; if
    it ever did, the two runs would share one seq count (a token could be stored twice), so the
    publisher says so."""
    from multiprocessing import Pipe

    from structlog.testing import capture_logs

    from service.delivery import StepOutput
    from service.publisher_process import START, STEP, Publisher
    from service.result_store import ResultStore

    client = redis_server.client()
    client.xgroup_create(STREAM, "schedulers", id="0", mkstream=True)
    _, outbox = Pipe()
    publisher = Publisher(ResultStore(client, KEYS, "s1", 60), None, outbox, "s1")
    with capture_logs() as logs:
        publisher.handle([(START, Delivery("r", STREAM, "1-0", 3), None),
                          (STEP, [StepOutput.of(_out("r", 7)), StepOutput.of(_out("q", 1))], 0.0)])
        publisher.handle([(START, Delivery("q", STREAM, "2-0", 3), None)])  # q was not live
        assert not [e for e in logs if e["event"] == "request_started_while_live"]
        publisher.handle([(START, Delivery("r", STREAM, "1-0", 3), None)])
    [warning] = [e for e in logs if e["event"] == "request_started_while_live"]
    assert (warning["req_id"], warning["live_seq"], warning["new_seq"]) == ("r", 1, 0)


def test_a_request_taken_back_is_not_given_its_previous_runs_outputs(redis_server) -> None:
    """A scheduler lost a request to a successor, then took it back, while its publisher was
    still behind (a Redis outage holds everything up): one batch holds the first run's last
    output, then the new run's start and its output. The start must not go ahead of the old
    output, which would then count as the new run's and store that token twice."""
    from multiprocessing import Pipe

    from service.delivery import StepOutput
    from service.publisher_process import START, STEP, Publisher
    from service.result_store import ResultStore

    client = redis_server.client()
    client.xgroup_create(STREAM, "schedulers", id="0", mkstream=True)
    _, outbox = Pipe()
    publisher = Publisher(ResultStore(client, KEYS, "s1", 60), None, outbox, "s1")
    record = KEYS.result("r")
    publisher.handle([(START, Delivery("r", STREAM, "1-0", 3), None)])
    publisher.handle([(STEP, [StepOutput.of(_out("r", 7))], 0.0)])
    client.hset(record, "owner", "s2")  # a successor claimed it
    publisher.handle([(STEP, [StepOutput.of(_out("r", 8))], 1.0)])  # refused: lost
    stored = client.hget(record, "token_ids") + pack_list_chunk([8])
    client.hset(record, mapping={"seq": 2, "token_ids": stored})
    assert unpack_list_chunks(client.hget(record, "token_ids")) == [7, 8]  # what s2 wrote
    client.hset(record, "owner", "s1")  # taken back (s2 died): resumed from [7, 8]
    resumed = Delivery("r", STREAM, "1-0", 3, seq=2, token_ids=[7, 8], offsets=[[1, 0], [2, 0]])
    publisher.handle([(STEP, [StepOutput.of(_out("r", 9))], 2.0),  # the first run's, made before its abort
                      (START, resumed, None),
                      (STEP, [StepOutput.of(_out("r", 9))], 3.0)])  # the new run's
    assert unpack_list_chunks(client.hget(record, "token_ids")) == [7, 8, 9]
    assert client.hget(record, "seq") == b"3"


def test_a_write_whose_reply_was_lost_is_retried_without_storing_a_token_twice(redis_server) -> None:
    """Redis ran a write of two steps of one request, and the connection went before its reply
    came (Redis stopping at that moment): the publisher sends the same write again. It must
    change nothing: the first update's fields once set the record's seq back, and the second
    then appended its token a second time."""
    from multiprocessing import Pipe

    from service.delivery import StepOutput
    from service.publisher_process import START, STEP, Publisher
    from service.result_store import ResultStore
    from shared.redis_client import connect
    from tests.reply_dropper import ReplyDropper

    client = redis_server.client()
    client.xgroup_create(STREAM, "schedulers", id="0", mkstream=True)
    pubsub = client.pubsub()
    pubsub.subscribe(KEYS.events("r"))
    with ReplyDropper(redis_server.port) as relay:
        _, outbox = Pipe()
        store = ResultStore(connect(relay.url, socket_timeout=10), KEYS, "s1", 60)
        publisher = Publisher(store, None, outbox, "s1")
        publisher.handle([(START, Delivery("r", STREAM, "1-0", 3), None)])
        publisher.handle([(STEP, [StepOutput.of(_out("r", 7))], 0.0)])
        relay.armed.set()
        publisher.handle([(STEP, [StepOutput.of(_out("r", 8))], 1.0),
                          (STEP, [StepOutput.of(_out("r", 9, finished=True))], 2.0)])
        assert relay.num_dropped == 1  # (the write ran, and was sent again)
    record = client.hgetall(KEYS.result("r"))
    assert unpack_list_chunks(record[b"token_ids"]) == [7, 8, 9]
    assert unpack_list_chunks(record[b"offsets"]) == [[1, 0], [2, 0], [3, 0]]
    assert record[b"seq"] == b"3" and record[b"state"] == b"completed"
    events = []
    while (message := pubsub.get_message(timeout=1.0)) is not None:
        if message["type"] == "message":
            events.append(decode_event(message["data"]))
    assert [e.seq for e in events] == [1, 2, 3]  # each event published once
