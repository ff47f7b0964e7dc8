"""The result publisher's process: each step's records and events, built and written to Redis
beside the engine, never on its GIL.

The engine's process sends it, in order, over one pipe: a request's start (its `Delivery`),
each step's outputs, ready updates, and the end of a request that never ran. This process
alone holds every delivery's state, turns outputs into text (detokenization) and updates,
and writes them with the store's fenced script, one call per round trip (what waits is joined
into one call, still in order). A write that cannot reach Redis is retried, with backoff,
before anything after it. After each write it reports back: how many messages are done, which
requests ended (terminal state written, entry acknowledged) and which a successor owns now.

A reader thread moves the pipe into a queue as fast as it comes, so that the engine's sends
never wait on a Redis write. The process dies with its parent (a successor resumes from what
was written).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from multiprocessing.connection import Connection

from protocol.keys import Keys
from scheduler.detokenizer import IncrementalDetokenizer
from service.delivery import Delivery, StepOutput
from service.result_store import ResultStore, ResultUpdate
from service.step_updates import step_update, unrun_update
from shared.logging import get_logger
from shared.pdeathsig import die_with_parent
from shared.redis_client import connect, redis_away, refresh_cluster_view

MAX_BACKOFF_S = 5.0

# Message kinds, first element of each tuple the engine sends.
START = "start"  # (START, Delivery, ResultUpdate | None: its running fields)
STEP = "step"  # (STEP, [StepOutput as tuple], now)
UPDATES = "updates"  # (UPDATES, [ResultUpdate])
UNRUN = "unrun"  # (UNRUN, req_id, state, code, message)


def serve(inbox: Connection, outbox: Connection, redis_url: str, keys: Keys, owner: str, ttl_s: int,
          tokenizer) -> None:
    """The process's main function (multiprocessing target)."""
    die_with_parent()
    client = connect(redis_url, socket_timeout=10, socket_connect_timeout=5)
    Publisher(ResultStore(client, keys, owner, ttl_s), tokenizer, outbox, owner).run(inbox)


class Publisher:
    def __init__(self, store: ResultStore, tokenizer, outbox: Connection, owner: str) -> None:
        self.store = store
        self.tokenizer = tokenizer
        self.outbox = outbox
        self.deliveries: dict[str, Delivery] = {}
        self.log = get_logger("tokenfleet.publisher", scheduler_id=owner, pid=os.getpid())

    def run(self, inbox: Connection) -> None:
        messages: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_read_pipe, args=(inbox, messages), name="pipe-reader", daemon=True).start()
        while True:
            batch = [messages.get()]
            while not messages.empty():
                batch.append(messages.get())
            stopping = None in batch
            batch = batch[:batch.index(None)] if stopping else batch
            updates = [update for message in batch for update in self._updates_of(message)]
            self._write(updates, len(batch))
            if stopping:
                return

    def _updates_of(self, message: tuple) -> list[ResultUpdate]:
        kind = message[0]
        if kind == STEP:
            _, outputs, now = message
            updates = []
            for raw in outputs:
                out = StepOutput._make(raw)
                delivery = self.deliveries.get(out.req_id)
                if delivery is not None and (update := step_update(delivery, out, now)) is not None:
                    updates.append(update)
            return updates
        if kind == START:
            _, delivery, running = message
            if delivery.detokenize_after is not None and self.tokenizer is not None:
                delivery.detokenizer = IncrementalDetokenizer(self.tokenizer, delivery.detokenize_after)
                delivery.detokenize_after = None
            self.deliveries[delivery.req_id] = delivery
            return [] if running is None else [running]
        if kind == UPDATES:
            return message[1]
        if kind == UNRUN:
            _, req_id, state, code, text = message
            delivery = self.deliveries.get(req_id)
            return [] if delivery is None else [unrun_update(delivery, state, code, text)]
        raise ValueError(f"unknown publisher message {kind!r}")

    def _write(self, updates: list[ResultUpdate], num_messages: int) -> None:
        packed = [self.store.pack(update) for update in updates]
        backoff = 0.1
        while True:
            try:
                owned = self.store.write_packed(packed)
                break
            except Exception as exc:
                if not redis_away(exc):
                    raise
                self.log.warning("result_write_failed", error=str(exc), retry_in_s=backoff)
                refresh_cluster_view(self.store.client)
                self._report(0, [], [], f"{type(exc).__name__}: {exc}")
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        lost = [u.req_id for u, is_owner in zip(updates, owned, strict=True) if not is_owner]
        ended = [u.req_id for u in updates if u.ack_entry_id is not None]
        for req_id in (*lost, *ended):
            self.deliveries.pop(req_id, None)
        self._report(num_messages, ended, lost, None)

    def _report(self, num_done: int, ended: list[str], lost: list[str], error: str | None) -> None:
        try:
            self.outbox.send((num_done, ended, lost, error))
        except (BrokenPipeError, OSError):
            pass  # the engine's process is gone; this one goes with it


def _read_pipe(inbox: Connection, messages: queue.SimpleQueue) -> None:
    try:
        while True:
            messages.put(inbox.recv())
    except (EOFError, OSError):
        messages.put(None)  # the engine closed its end: write what came, then stop
