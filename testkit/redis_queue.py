"""The request queue seen from outside the fleet: request messages XADDed, waiting until they
ended, their results; and a listener process that timestamps token events as Redis publishes
them (a bare socket, parsed afterwards by hiredis, so the timestamps cost nothing)."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import hiredis
import msgpack
import redis

from protocol.keys import Keys
from protocol.messages import RequestMessage
from shared.sampling import SamplingParams
from testkit.processes import Children

KEYS = Keys()


def submit_requests(client: redis.Redis, model: str, prompts: list[list[int]], params: list[SamplingParams],
                    *, kind: str = "interactive") -> tuple[list[str], float]:
    """XADD a RequestMessage per prompt, all in one pipeline; (request ids, time.monotonic() just
    before the pipeline was sent)."""
    messages = [RequestMessage.make(uuid.uuid4().hex, model, prompt, sp, kind=kind, arrival_time=time.time())
                for prompt, sp in zip(prompts, params, strict=True)]
    stream = KEYS.request_stream(model, kind)
    pipe = client.pipeline(transaction=False)
    for message in messages:
        pipe.xadd(stream, {"m": message.encode()})
    start = time.monotonic()
    pipe.execute()
    return [m.req_id for m in messages], start


def wait_drained(client: redis.Redis, model: str, timeout_s: float, *, children: Children | None = None,
                 kind: str = "interactive", poll_s: float = 0.05) -> None:
    """Until the model's request stream is empty. A scheduler deletes an entry in the same call
    that writes its terminal state, so one XLEN a poll says every request ended, where polling
    each request's state would load Redis (and steal the scheduler's cores on a small machine)."""
    stream = KEYS.request_stream(model, kind)
    deadline = time.monotonic() + timeout_s
    while num_left := client.xlen(stream):
        if children is not None:
            children.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{num_left} requests not ended after {timeout_s:.0f} s")
        time.sleep(poll_s)


def read_results(client: redis.Redis, req_ids: list[str]) -> dict[str, dict[bytes, bytes]]:
    """req_id -> its tf:res hash."""
    pipe = client.pipeline(transaction=False)
    for req_id in req_ids:
        pipe.hgetall(KEYS.result(req_id))
    return dict(zip(req_ids, pipe.execute(), strict=True))


def completion_tokens(record: dict[bytes, bytes]) -> int | None:
    """usage.completion_tokens of a tf:res hash that reached a terminal state."""
    return json.loads(record[b"usage"])["completion_tokens"] if b"usage" in record else None


@dataclass
class Event:
    t: float  # time.monotonic() when the bytes that completed it arrived
    seq: int
    text: str
    final: bool
    num_tokens: int = 0


def listen(port: int, pattern: str, out_path: str, ready, stop) -> None:
    """PSUBSCRIBE on a bare socket and keep (arrival time, bytes) of every recv; parse later,
    so the timestamps are when Redis's bytes reached a process that does nothing else."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    chunks: list[tuple[float, bytes]] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.sendall(hiredis.pack_command((b"PSUBSCRIBE", pattern.encode())))
        first = b""
        while b"psubscribe" not in first:
            first += sock.recv(1 << 16)
        chunks.append((time.monotonic(), first))
        ready.set()
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                continue
            now = time.monotonic()
            if not data:
                break
            chunks.append((now, data))
    with open(out_path, "wb") as f:
        pickle.dump(chunks, f)


def parse_listener(chunks: list[tuple[float, bytes]]) -> dict[str, list[Event]]:
    """req_id -> its events in arrival order; each timed by the recv that completed it."""
    reader = hiredis.Reader()
    events: dict[str, list[Event]] = {}
    for t, chunk in chunks:
        reader.feed(chunk)
        while (message := reader.gets()) is not False:
            if not (isinstance(message, list) and message and message[0] == b"pmessage"):
                continue
            event = msgpack.unpackb(message[3], raw=False)
            final = event.get("type") == "error" or event.get("finish_reason") is not None
            events.setdefault(event["req_id"], []).append(
                Event(t, event["seq"], event.get("text") or "", final, len(event.get("token_ids") or ())))
    return events


class EventListener:
    """`listen` in its own process, subscribed to every token event (tf:ev:*) while in the
    `with` block; events() then gives what it saw."""

    def __init__(self, redis_port: int, out_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA
        self.ready, self.stop_event = ctx.Event(), ctx.Event()
        self.out_path = out_path
        self.process = ctx.Process(target=listen, args=(redis_port, KEYS.events("*"), str(out_path),
                                                        self.ready, self.stop_event), daemon=True)

    def __enter__(self) -> EventListener:
        self.process.start()
        if not self.ready.wait(60):
            self.close()
            raise RuntimeError("the pub/sub listener did not subscribe")
        return self

    def close(self) -> None:
        self.stop_event.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)

    def __exit__(self, *exc) -> None:
        self.close()

    def events(self) -> dict[str, list[Event]]:
        """req_id -> its events in arrival order (after the block)."""
        with open(self.out_path, "rb") as f:
            return parse_listener(pickle.load(f))
