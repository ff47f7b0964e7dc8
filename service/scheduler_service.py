"""`tokenfleet scheduler`: the Redis service loop around one engine (scheduler core + group).

One tick:
    maintenance (heartbeat, renew claims, take over entries of dead schedulers,
    cancel/expire)  ->  admit the entries the admission reader's thread read meanwhile, only as
    many as the engine can take (pull-based: replicas share load without a router;
    service/admission_reader.py)  ->  one engine step  ->  hand every change to the result
    writer, whose thread publishes and mirrors them in one round trip while the next step runs,
    from a process of its own (service/result_publisher.py).
A request's stream entry is acknowledged only together with its terminal state, so a
scheduler that dies leaves its entries pending for a successor, which resumes each from
the tokens stored in tf:res:{id}: the client sees neither a gap nor a duplicate.

Draining (scale-down): when tf:drain:{scheduler_id} appears (checked at each maintenance),
the scheduler reads no new entries and takes none over, finishes what it runs, removes its
heartbeat and returns from `run`. Whatever is still running at the drain's deadline is left
pending: another scheduler takes it over after the lease, as after a crash.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import redis

from protocol.keys import CONSUMER_GROUP, Keys, keys_for
from protocol.messages import TERMINAL_STATES, DeadLetter, MessageDecodeError, RequestMessage
from protocol.result_record import EXPIRED_MESSAGE, ErrorCode, RequestState, StoredProgress, running_fields
from scheduler.detokenizer import NUM_PROMPT_CONTEXT_TOKENS as DETOKENIZER_CONTEXT
from scheduler.engine import LLMEngine
from scheduler.request import BATCH_PRIORITY
from scheduler.scheduler import RequestOutput
from service import stream_reads
from service.admission_reader import AdmissionReader, ReadEntry, decode_entry
from service.claim_renewer import ClaimRenewer
from service.delivery import Delivery
from service.inflight import Flights, InFlight, ServiceSettings
from service.lora_adapters import ServiceLoras
from service.maintenance import Maintenance
from service.prefix_summary import PrefixSummary
from service.replica_streams import ReplicaStreams, RoutingMetrics
from service.result_publisher import ResultPublisher
from service.result_store import ResultStore, ResultUpdate
from service.telemetry import SchedulerTelemetry
from service.tenant_streams import TenantStreams
from shared.errors import InvalidRequestError
from shared.logging import get_logger
from shared.redis_client import connect, redis_away, refresh_cluster_view

MAX_BACKOFF_S = 5.0
# A service ticked by hand (no reader thread: tests) that found its streams empty while busy
# looks again after this long, not every step: each look is a round trip on the ticking thread.
ADMISSION_POLL_S = 0.005


class SchedulerService(Maintenance):
    def __init__(self, engine: LLMEngine, redis_url: str, settings: ServiceSettings,
                 keys: Keys | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.keys = keys or keys_for(redis_url)
        self.client = connect(redis_url, socket_timeout=10, socket_connect_timeout=5)
        self.redis_url = redis_url
        self.results = ResultStore(self.client, self.keys, settings.scheduler_id, settings.result_ttl_s)
        self.log = get_logger("tokenfleet.scheduler", scheduler_id=settings.scheduler_id)
        # kind -> its streams: the model's plain one, then one per tenant (service/tenant_streams.py)
        self.tenant_streams = TenantStreams(self.keys, settings.model_name)
        self.inflight = Flights()  # req_id -> request this scheduler owns
        # req_id -> request the engine finished whose terminal write has not landed yet: its
        # entry is still ours (renewed, never admitted again) until the writer says it landed.
        self._finishing = Flights()
        self._told_renewer = (-1, -1)  # the (inflight, finishing) versions the renewer was told
        # Builds and writes each step's records and events in a process of its own.
        self.writer = ResultPublisher(redis_url, self.keys, settings.scheduler_id, settings.result_ttl_s,
                                      engine.tokenizer, num_processes=settings.num_publishers)
        self.renewer = ClaimRenewer(self.client, settings.scheduler_id, settings.heartbeat_s,
                                    settings.max_tick_s)
        # Text is made by the publisher, except where stop strings need it in the engine.
        engine.scheduler.text_for_stop_strings_only = True
        self._pending: list[ResultUpdate] = []  # this tick's updates, handed to the writer at its end
        # Requests started since the last flush (each its delivery and running fields): handed to
        # the writer together, one message per publisher process, ahead of any update queued after.
        self._starts: list[tuple[Delivery, ResultUpdate | None]] = []
        self._cancel_ids: set[str] = set()  # from the tf:cancel listener thread
        self._cancel_lock = threading.Lock()
        self._next_maintenance = 0.0
        self._next_admission_poll = 0.0
        self._groups_ready = False
        self.telemetry = SchedulerTelemetry(engine, settings.model_name, settings.scheduler_id,
                                            settings.log_stats_interval_s)
        self.drain_deadline: float | None = None  # set once a drain was asked for (unix seconds)
        # Its own stream (routed requests) and its peers' (service/replica_streams.py).
        self.replica_streams = ReplicaStreams(self.client, self.keys, settings.model_name,
                                              settings.scheduler_id, steal_after_s=settings.steal_after_s)
        self.telemetry.metrics.registry.register(
            RoutingMetrics(self.replica_streams, [settings.model_name, settings.scheduler_id]))
        self.prefix_summary = PrefixSummary(engine.scheduler)
        self.loras = ServiceLoras(self.client, self.keys, settings.model_name, engine)
        # Reads and decodes the streams on a thread of its own while `run` loops (on a connection
        # of its own: a blocking read holds it), for `_admit` to take.
        self.reader = AdmissionReader(
            connect(redis_url, socket_timeout=10 + settings.idle_block_ms / 1000, socket_connect_timeout=5),
            self.keys, settings.model_name, settings.scheduler_id, self.replica_streams.own,
            block_ms=settings.idle_block_ms,
            on_held=lambda entries: self.renewer.update(entries, source="reader"))

    @property
    def is_draining(self) -> bool:
        return self.drain_deadline is not None

    # -- the loop -----------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.engine.prepare_grammars()  # before the first read: no request waits for it
        listener = threading.Thread(target=self._listen_for_cancels, args=(stop,), daemon=True)
        listener.start()
        renewer = threading.Thread(target=self.renewer.run, args=(stop,), name="claim-renewer", daemon=True)
        renewer.start()
        self.reader.start(stop)
        try:
            self.loras.publish_declared()
        except redis.RedisError as exc:  # written again when a request names one of them
            self.log.warning("lora_publish_failed", error=str(exc))
        backoff = 0.1
        self.log.info("scheduler_started", model=self.settings.model_name, streams=self.streams)
        while not stop.is_set():
            try:
                self.tick()
                if self.is_draining and self._drain_done():
                    break
                backoff = 0.1
            except Exception as exc:
                if not redis_away(exc):
                    if isinstance(exc, redis.ResponseError) and "NOGROUP" in str(exc):
                        # A stream lost its consumer group (FLUSHALL, a Redis restarted without
                        # its data): make the groups again instead of dying.
                        self.log.warning("consumer_group_missing", error=str(exc))
                        self._groups_ready = False
                        continue
                    raise
                self._flush()  # the publisher keeps them, in order, until Redis is back
                refresh_cluster_view(self.client)
                self.log.warning("redis_unreachable", error=str(exc), retry_in_s=backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
        self._flush()
        self.writer.close()
        stop.set()  # (the listener's and renewer's signal, also when the loop ended by draining)
        listener.join(timeout=5)
        renewer.join(timeout=5)
        self.reader.join(timeout_s=5)  # (what it read and nobody started stays pending for a successor)

    def tick(self) -> None:
        self.writer.poll()
        if self.writer.error is not None:
            raise self.writer.error  # Redis is away: pause (the writer retries what it holds)
        if (error := self.reader.take_error()) is not None:
            raise error  # (the reader retries by itself; this loop pauses or makes the groups again)
        if not self._groups_ready:
            self._ensure_groups()
        self._drop_lost_requests()
        if time.monotonic() >= self._next_maintenance:
            self._maintain()
            self._next_maintenance = time.monotonic() + self.settings.heartbeat_s
        self.telemetry.tick()
        self._apply_cancellations()
        self._admit(block=not self.engine.has_unfinished_requests())
        if self.engine.has_unfinished_requests():
            self._tell_renewer()  # (what it renews while this step runs)
            self._hand_over_step(self.engine.step())
            self.reader.set_room(*self._capacity())  # (slots the step freed: read while this tick ends)
        elif self.is_draining:
            time.sleep(0.01)  # waiting for the publisher's last writes, not reading the streams
        self._flush()

    @property
    def streams(self) -> list[str]:
        """Every stream this scheduler reads, its own first, then interactive ones."""
        return [self.replica_streams.own, *self.tenant_streams.all()]

    def _ensure_groups(self, streams: list[str] | None = None) -> None:
        stream_reads.create_groups(self.client, self.streams if streams is None else streams)
        if streams is None:
            self.replica_streams.register()  # (after its group exists: peers may read it from now on)
        self._groups_ready = True

    def _hand_over_step(self, outputs: list[RequestOutput]) -> None:
        """Give the publisher what the step produced (of the requests this scheduler owns); it
        builds the events and records while the next step runs. A request that ends here leaves
        `inflight` at once, so admission sees its slot free."""
        now = time.time()
        step = [out for out in outputs if out.req_id in self.inflight]
        for out in outputs:
            if out.finished and (flight := self.inflight.pop(out.req_id, None)) is not None:
                self._finishing[out.req_id] = flight
        self._flush()  # what this tick queued before the step goes first
        self.writer.submit_step(step, now)

    def _flush(self) -> None:
        """Hand this tick's updates to the publisher (in order after everything before)."""
        starts, self._starts = self._starts, []
        if starts:  # (started before anything now pending was queued)
            self.writer.start_many(starts)
        updates, self._pending = self._pending, []
        self.writer.submit(updates)

    def flush_and_wait(self) -> None:
        """Everything so far written to Redis (for callers that read it back at once); raises
        the writer's error while Redis is away."""
        self._flush()
        while not self.writer.drain(0.5):
            if self.writer.error is not None:
                raise self.writer.error

    def _tell_renewer(self) -> None:
        """The entries it owns, to the claim renewer: rebuilt only when they changed."""
        versions = (self.inflight.version, self._finishing.version)
        if versions == self._told_renewer:
            self.renewer.touch()
            return
        self._told_renewer = versions
        self.renewer.update(self._owned_entries())

    def _drop_lost_requests(self) -> None:
        for req_id in self.writer.take_ended():
            self._finishing.pop(req_id, None)
        for req_id in self.writer.take_lost():
            self._finishing.pop(req_id, None)
            if req_id in self.inflight:
                # A successor claimed it while we thought we had it: stop generating it.
                self.log.warning("ownership_lost", req_id=req_id)
                self.inflight.pop(req_id)
                self.engine.abort(req_id)

    # -- admission ------------------------------------------------------------------------

    def _capacity(self) -> tuple[int, int]:
        """(interactive, batch) entries to read now. Batch items fill free slots only; an
        interactive request may also take a slot a batch item holds (the engine preempts it)."""
        scheduler = self.engine.scheduler
        in_engine = scheduler.num_running_requests + scheduler.num_waiting_requests
        max_num_seqs = self.engine.config.max_num_seqs
        return max_num_seqs - (in_engine - self.inflight.num_batch), max_num_seqs - in_engine

    def _admit(self, *, block: bool) -> None:
        """Start what the admission reader read since the last tick: no Redis round trip unless
        something came (then one, the claim). An idle engine waits for an arrival. While
        draining, only what it read before the drain began is started."""
        if not self.is_draining:
            self.reader.set_room(*self._capacity())
            if not self.reader.is_running:
                self._read_here(block)
        wait_s = self.settings.idle_block_ms / 1000 if block and not self.is_draining else 0.0
        self._admit_read(self.reader.take(wait_s))

    def _read_here(self, block: bool) -> None:
        """A service ticked by hand, with no reader thread (tests): read on this thread now,
        blocking while idle, and looking again only every ADMISSION_POLL_S while busy."""
        if not block and time.monotonic() < self._next_admission_poll:
            return
        if not self.reader.read_now(self.settings.idle_block_ms if block else None) and not block:
            self._next_admission_poll = time.monotonic() + ADMISSION_POLL_S

    def _admit_entries(self, entries: list[tuple[str, str, dict | None, int]]) -> None:
        """Start the requests of stream entries (stream, entry id, fields, deliveries so far)
        read on this thread (takeover, a peer's stream)."""
        self._admit_read([decode_entry(stream, entry_id, fields, num_deliveries)
                          for stream, entry_id, fields, num_deliveries in entries])

    def _admit_read(self, entries: list[ReadEntry]) -> None:
        """Start the requests of entries read and decoded. Their records are claimed, and their
        cancel flags read, in one round trip for all."""
        admitted: list[tuple[ReadEntry, RequestMessage]] = []
        seen: set[str] = set()  # a request read twice in one batch starts once
        for entry in entries:
            message = self._check_entry(entry)
            if message is not None and message.req_id not in seen:
                seen.add(message.req_id)
                admitted.append((entry, message))
        if not admitted:
            return
        req_ids = [message.req_id for _, message in admitted]
        progress, cancelled = self.results.claim_many(req_ids, [self.keys.cancelled(r) for r in req_ids])
        for (entry, message), stored, is_cancelled in zip(admitted, progress, cancelled, strict=True):
            self.replica_streams.count(entry.stream)
            self._start(entry.stream, entry.entry_id, entry.num_deliveries, entry.payload, message, stored,
                        is_cancelled)
        self._flush()  # the starts go to the publisher before the step runs

    def _check_entry(self, entry: ReadEntry) -> RequestMessage | None:
        """The entry's request, or None: undecodable (set aside in tf:dead), or a request this
        engine holds already. (Whether it was delivered too often is judged once its record is
        read: a leftover entry of a request that has ended is only acknowledged.)"""
        stream, entry_id, num_deliveries, message = (entry.stream, entry.entry_id, entry.num_deliveries,
                                                     entry.message)
        if message is None:
            self._dead_letter(stream, entry_id, f"undecodable: {entry.error}", num_deliveries, entry.payload)
            return None
        # Ours already (claimed back from ourselves, or a duplicate entry), or lost to another
        # scheduler this tick with its abort not yet reported: either way the engine holds it, so
        # it cannot start here again, and in the second case its record is the new owner's.
        is_held = message.req_id in self.inflight or message.req_id in self._finishing
        if is_held or self.engine.scheduler.get_request(message.req_id) is not None:
            self._leave_pending(stream, entry_id, num_deliveries)
            self.log.info("redelivered_request_held", req_id=message.req_id, entry_id=entry_id,
                          is_ours=is_held)
            return None
        return message

    def _leave_pending(self, stream: str, entry_id: str, num_deliveries: int) -> None:
        """Leave an entry pending, its delivery to us uncounted: it says nothing of the entry
        being poison. Its owner renews it; if none does, it is taken over after the lease."""
        self.client.xclaim(stream, CONSUMER_GROUP, self.settings.scheduler_id, 0, [entry_id],
                           retrycount=max(0, num_deliveries - 1), justid=True)

    def _start(self, stream: str, entry_id: str, num_deliveries: int, payload: bytes,
               message: RequestMessage, progress: StoredProgress, is_cancelled: bool) -> None:
        flight = InFlight(message.req_id, stream, entry_id, deadline=message.deadline,
                          batch_job_id=message.batch_job_id)
        delivery = _delivery(flight, progress, len(message.prompt_token_ids))
        if progress.state in TERMINAL_STATES:
            self._pending.append(ResultUpdate(message.req_id, stream, {}, ack_entry_id=entry_id))
            return  # (no notice: the write that made it terminal sent one)
        if is_cancelled:
            self._finish_unrun(flight, "cancelled", "cancelled", "cancelled before it started", delivery)
            return
        if message.deadline is not None and time.time() > message.deadline and not progress.token_ids:
            self._finish_unrun(flight, "expired", "expired", EXPIRED_MESSAGE, delivery)
            return
        if num_deliveries > self.settings.max_deliveries:
            self._dead_letter(stream, entry_id, f"delivered {num_deliveries} times", num_deliveries,
                              payload, message.req_id, message.batch_job_id)
            return
        try:
            sampling = message.sampling_params()
            if progress.token_ids and sampling.prompt_logprobs is not None:
                # Sent with the first token, which an earlier owner delivered: not computed again.
                sampling = dataclasses.replace(sampling, prompt_logprobs=None)
            delivery.wants_logprobs = sampling.logprobs is not None
            # Batch items rank below every interactive request: an interactive arrival preempts
            # batch work when slots or blocks are short.
            priority = message.priority + (BATCH_PRIORITY if flight.is_batch else 0)
            if message.lora_name is not None:
                self.loras.ensure(message.lora_name)
            pooling = message.pooling_params()  # an embedding request (--runner pooling)
            self.engine.add_request(
                message.prompt_token_ids, sampling, priority=priority, req_id=message.req_id,
                arrival_time=message.arrival_time, output_token_ids=progress.token_ids,
                output_text=progress.text, tenant=message.tenant, lora_name=message.lora_name,
                pooling=pooling,
            )
        except (InvalidRequestError, MessageDecodeError) as exc:
            text = getattr(exc, "message", str(exc))
            # tf:dead keeps the reason as text; the record says it by its code, without the prefix.
            self._dead_letter(stream, entry_id, f"invalid: {text}", num_deliveries, payload, message.req_id,
                              message.batch_job_id, code=ErrorCode.INVALID_REQUEST, message=text)
            return
        if self.engine.tokenizer is not None and not sampling.stop and pooling is None:
            # Decoding continues after what an earlier owner already delivered, as in the engine.
            context = message.prompt_token_ids[-DETOKENIZER_CONTEXT:]
            delivery.detokenize_after = [*context, *progress.token_ids]
        self.inflight[message.req_id] = flight
        if self._pending:
            self._flush()  # (what was queued before goes first)
        self._starts.append((delivery, ResultUpdate(message.req_id, stream, running_fields(
            model=self.settings.model_name, prompt_tokens=delivery.num_prompt_tokens,
            scheduler=self.settings.scheduler_id, resumed_from_seq=progress.seq))))
        if progress.seq:
            self.log.info("request_resumed", req_id=message.req_id, from_seq=progress.seq,
                          previous_owner=progress.owner)

    def _finish_unrun(self, flight: InFlight, state: str, code: str, message: str,
                      delivery: Delivery | None = None) -> None:
        """End a request that made no token here: an ErrorEvent and a terminal record, built by
        the publisher, which holds its delivery (given here for one that never started)."""
        self._flush()
        if delivery is not None:
            self.writer.start(delivery, None)
        self.writer.finish_unrun(flight.req_id, state, code, message)

    def _dead_letter(self, stream: str, entry_id: str, reason: str, num_deliveries: int,
                     payload: bytes | None, req_id: str | None = None, batch_job_id: str | None = None,
                     code: ErrorCode = ErrorCode.DEAD_LETTER, message: str | None = None) -> None:
        """Set a poison entry aside in tf:dead (with a failed result when it names a request)."""
        self.log.warning("dead_letter", stream=stream, entry_id=entry_id, reason=reason, req_id=req_id)
        letter = DeadLetter(stream, entry_id, reason, num_deliveries, req_id, payload or b"")
        self.flush_and_wait()  # keep the order of writes
        self.client.xadd(self.keys.dead, {"m": letter.encode()})
        if req_id is not None:
            progress = self.results.claim(req_id)
            flight = InFlight(req_id, stream, entry_id, batch_job_id=batch_job_id)
            self._finish_unrun(flight, RequestState.FAILED.value, code.value,
                               reason if message is None else message, _delivery(flight, progress, 0))
        else:
            pipe = self.client.pipeline()
            pipe.xack(stream, CONSUMER_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            pipe.execute()

def _delivery(flight: InFlight, progress: StoredProgress, num_prompt_tokens: int) -> Delivery:
    """What the client of a request just claimed was sent before (by an earlier owner)."""
    return Delivery(flight.req_id, flight.stream, flight.entry_id, num_prompt_tokens, seq=progress.seq,
                    token_ids=list(progress.token_ids), text=progress.text, offsets=list(progress.offsets),
                    batch_job_id=flight.batch_job_id)
