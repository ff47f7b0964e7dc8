"""The result publisher's process: each step's records and events, built and written to Redis
beside the engine, never on its GIL.

The engine's process sends it, in order, over one pipe: a request's start (its `Delivery`),
each step's outputs, ready updates, and the end of a request that never ran. This process
alone holds every delivery's state, turns outputs into text (detokenization) and updates,
and writes them with the store's fenced script, one call per round trip (what waits is joined
into one call, still in order). A write that cannot reach Redis is retried, with backoff,
before anything after it. After each write it reports back: how many messages are done, which
requests ended (terminal state written, entry acknowledged) and which a successor owns now.

First tokens go first: a request's time to first token is what a user waits on, and one
call's events reach their subscribers only once the whole call has run (Redis flushes pub/sub
after the script). So the updates that carry a request's first token (with its start before
them) are built and written in a call of their own, before the rest of what came (at 48
req/s on the H200 a step's call covers ~150 requests). A request's updates keep their order:
one with anything left for the second call before its first token stays there whole.

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
from service.step_updates import step_update, unrun_update, whole_record_updates
from shared.gc_tuning import tune_for_serving
from shared.logging import get_logger
from shared.pdeathsig import die_with_parent
from shared.redis_client import connect, redis_away, refresh_cluster_view

MAX_BACKOFF_S = 5.0

# Message kinds, first element of each tuple the engine sends.
START = "start"  # (START, Delivery, ResultUpdate | None: its running fields)
STEP = "step"  # (STEP, [StepOutput as tuple], now)
UPDATES = "updates"  # (UPDATES, [ResultUpdate])
UNRUN = "unrun"  # (UNRUN, req_id, state, code, message)
STARTS = "starts"  # (STARTS, [(Delivery, ResultUpdate | None)]): a START each, dealt out on arrival


def serve(inbox: Connection, outbox: Connection, redis_url: str, keys: Keys, owner: str, ttl_s: int,
          tokenizer) -> None:
    """The process's main function (multiprocessing target)."""
    die_with_parent()
    client = connect(redis_url, socket_timeout=10, socket_connect_timeout=5)
    publisher = Publisher(ResultStore(client, keys, owner, ttl_s), tokenizer, outbox, owner)
    tune_for_serving()  # the tokenizer is here: it leaves the collector's walks (shared/gc_tuning.py)
    publisher.run(inbox)


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
            self.handle(batch[:batch.index(None)] if stopping else batch)
            if stopping:
                return

    def handle(self, batch: list[tuple]) -> None:
        """Write what a batch of messages says: the first tokens' call, then the rest's."""
        first, rest = self._split_first_tokens(batch)
        if first and rest:
            self._write([u for message in first for u in self._updates_of(message)], 0)
            first = []
        self._write([u for message in (*first, *rest) for u in self._updates_of(message)], len(batch))

    def _split_first_tokens(self, batch: list[tuple]) -> tuple[list[tuple], list[tuple]]:
        """(what leads to a first token, everything else), each in order: a START, and the step
        output that brings its request's first token, go to the first, unless something of
        that request came before it in the batch (STEP messages are split by output)."""
        first: list[tuple] = []
        rest: list[tuple] = []
        starting: set[str] = set()  # started in this batch, no token yet
        later: set[str] = set()  # requests with something in `rest`: the rest of theirs follows
        for message in batch:
            kind = message[0]
            if kind == START:
                delivery = message[1]
                # Never ahead of an earlier message of its request (the last outputs of a run
                # lost to a successor, then taken back while this process was behind): built
                # after this start, they would count as the new run's, and a token be stored twice.
                is_new = (delivery.first_token_at is None and not delivery.is_batch
                          and delivery.req_id not in later and delivery.req_id not in starting)
                (starting.add if is_new else later.add)(delivery.req_id)
                (first if is_new else rest).append(message)
            elif kind == STEP:
                _, outputs, now = message
                leading, trailing = [], []
                for raw in outputs:
                    req_id = raw[0]
                    if req_id not in later and self._brings_first_token(req_id, raw, starting):
                        leading.append(raw)
                        starting.discard(req_id)
                        later.add(req_id)  # (its next outputs: the second call)
                    else:
                        trailing.append(raw)
                        later.add(req_id)
                if leading:
                    first.append((STEP, leading, now))
                if trailing:
                    rest.append((STEP, trailing, now))
            else:  # UPDATES, UNRUN
                later.update([message[1]] if kind == UNRUN else [update.req_id for update in message[1]])
                rest.append(message)
        return first, rest

    def _brings_first_token(self, req_id: str, raw: tuple, starting: set[str]) -> bool:
        if not raw[1]:  # no new token ids
            return False
        if req_id in starting:
            return True
        delivery = self.deliveries.get(req_id)
        return delivery is not None and delivery.first_token_at is None and not delivery.is_batch

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
            if (live := self.deliveries.get(delivery.req_id)) is not None:
                # The engine thread never starts a request that is still live here (it ended,
                # or a successor took it, before it can start again): two runs would share one
                # seq count and could store a token twice. Said loudly, for whoever sees it.
                self.log.warning("request_started_while_live", req_id=delivery.req_id, live_seq=live.seq,
                                 live_tokens=len(live.token_ids), new_seq=delivery.seq,
                                 new_tokens=len(delivery.token_ids))
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
        owned, gaps = self._write_until_done(updates)
        if gaps:  # records that lost writes: each set whole, from what this process delivered
            gapped: dict[str, list[ResultUpdate]] = {}
            for i in gaps:
                gapped.setdefault(updates[i].req_id, []).append(updates[i])
            self.log.warning("result_records_rewritten", req_ids=list(gapped))
            rewrites = [u for req_id, its in gapped.items() if (delivery := self.deliveries.get(req_id))
                        for u in whole_record_updates(delivery, its)]
            rewritten, _ = self._write_until_done(rewrites)
            refused = {u.req_id for u, is_owner in zip(rewrites, rewritten, strict=True) if not is_owner}
            owned = [is_owner and u.req_id not in refused for u, is_owner in zip(updates, owned, strict=True)]
        lost = [u.req_id for u, is_owner in zip(updates, owned, strict=True) if not is_owner]
        ended = [u.req_id for u in updates if u.ack_entry_id is not None]
        for req_id in (*lost, *ended):
            self.deliveries.pop(req_id, None)
        self._report(num_messages, ended, lost, None)

    def _write_until_done(self, updates: list[ResultUpdate]) -> tuple[list[bool], list[int]]:
        """The store's write (owned, gaps), retried with backoff while Redis is away."""
        packed = [self.store.pack(update) for update in updates]
        backoff = 0.1
        while True:
            try:
                return self.store.write_packed(packed)
            except Exception as exc:
                if not redis_away(exc):
                    raise
                self.log.warning("result_write_failed", error=str(exc), retry_in_s=backoff)
                refresh_cluster_view(self.store.client)
                self._report(0, [], [], f"{type(exc).__name__}: {exc}")
                time.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _report(self, num_done: int, ended: list[str], lost: list[str], error: str | None) -> None:
        try:
            self.outbox.send((num_done, ended, lost, error))
        except (BrokenPipeError, OSError):
            pass  # the engine's process is gone; this one goes with it


def _read_pipe(inbox: Connection, messages: queue.SimpleQueue) -> None:
    try:
        while True:
            message = inbox.recv()
            if message[0] == STARTS:
                for delivery, running in message[1]:
                    messages.put((START, delivery, running))
            else:
                messages.put(message)
    except (EOFError, OSError):
        messages.put(None)  # the engine closed its end: write what came, then stop
