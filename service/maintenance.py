"""A scheduler service's periodic duties (drain, heartbeat, claims, takeover, cancel and expiry)
and its cancellations: the part of SchedulerService that runs between steps, split off by
concern. A mixin: it works on the service's own attributes (see SchedulerService.__init__).
"""

from __future__ import annotations

import threading
import time

from protocol import registry
from protocol.keys import CONSUMER_GROUP
from protocol.result_record import EXPIRED_MESSAGE
from scheduler.request import RequestStatus
from shared.redis_client import connect, get_many, redis_away


class Maintenance:
    # -- maintenance ---------------------------------------------------------------------

    def _maintain(self) -> None:
        self._check_drain()
        self._heartbeat()
        self._renew_claims()
        if not self.is_draining:
            room, _ = self._capacity()
            idle = self.engine.scheduler.num_waiting_requests == 0
            self._admit_entries([(stream, entry_id, fields, 1) for stream, entry_id, fields
                                 in self.replica_streams.find_work(room, idle=idle)])
            self._take_over_abandoned()
        self._check_cancel_keys_and_deadlines()

    def _check_drain(self) -> None:
        if self.is_draining:
            return
        value = self.client.get(self.keys.drain(self.settings.scheduler_id))
        if value is None:
            return
        try:
            self.drain_deadline = float(value)
        except ValueError:
            self.drain_deadline = float("inf")  # any other value: drain with no deadline
        # Nothing is read once the heartbeat says draining (a read in flight is waited out); what
        # the reader read before is started with the rest.
        self.reader.stop_reading(timeout_s=self.settings.idle_block_ms / 1000 + 1.0)
        self.log.info("drain_started", num_inflight=len(self.inflight), deadline=self.drain_deadline)

    def _drain_done(self) -> bool:
        """Whether a draining scheduler may stop now: nothing left, or the deadline passed (what
        is left stays pending for a successor). Its heartbeat and drain keys go with it."""
        is_empty = not (self.inflight or self._finishing or self.engine.has_unfinished_requests())
        if not is_empty and time.time() < self.drain_deadline:
            return False
        self.flush_and_wait()
        self._drop_lost_requests()
        registry.leave(self.client, self.keys, registry.SCHEDULERS, self.settings.scheduler_id)
        self.client.delete(self.keys.scheduler(self.settings.scheduler_id),
                           self.keys.drain(self.settings.scheduler_id))
        # (entries the reader read as the drain began are pending too: never started here)
        left = sorted([*self.inflight, *self._finishing, *(e.entry_id for e in self.reader.left_unstarted)])
        if not left:  # (a consumer's pending entries go with it: only one that owns none leaves)
            self.renewer.update([])  # (an XCLAIM would make the consumer again)
            for stream in self.streams:
                self.client.xgroup_delconsumer(stream, CONSUMER_GROUP, self.settings.scheduler_id)
        self.log.info("drained", num_left_for_takeover=len(left), req_ids=left[:16])
        return True

    def _heartbeat(self) -> None:
        scheduler = self.engine.scheduler
        key = self.keys.scheduler(self.settings.scheduler_id)
        # What its KV cache holds or is computing, for the gateways' routing.
        summary = self.prefix_summary.build(filter(None, map(scheduler.get_request, self.inflight)))
        pipe = self.client.pipeline()
        pipe.hset(key, mapping={
            "model": self.settings.model_name, "num_running": scheduler.num_running_requests,
            "num_waiting": scheduler.num_waiting_requests, "kv_usage": scheduler.block_manager.usage,
            "max_num_seqs": self.engine.config.max_num_seqs, "updated_at": time.time(),
            **self.telemetry.heartbeat_fields(),
            "draining": int(self.is_draining),
            # Since the scheduler started, in prompt tokens (vLLM's counters of the same names).
            "prefix_cache_queries": scheduler.block_manager.prefix_cache_queries,
            "prefix_cache_hits": scheduler.block_manager.prefix_cache_hits,
            **self.replica_streams.heartbeat_fields(), **self.prefix_summary.heartbeat_fields(),
        })
        ttl_s = max(2, int(3 * self.settings.heartbeat_s))
        pipe.expire(key, ttl_s)
        pipe.set(self.keys.prefix_summary(self.settings.scheduler_id), summary, ex=ttl_s)
        metrics_key = self.keys.scheduler_metrics(self.settings.scheduler_id)
        pipe.set(metrics_key, self.telemetry.exposition(), ex=ttl_s)
        pipe.execute()
        # Listed after its hash is written: a reader that finds it in the registry finds its hash.
        registry.beat(self.client, self.keys, registry.SCHEDULERS, self.settings.scheduler_id, ttl_s)

    def _renew_claims(self) -> None:
        """Reset the idle time of every entry we own, so nobody takes it over (the renewer's
        thread does it too, every heartbeat, while a step runs)."""
        self.renewer.update(self._owned_entries())
        self.renewer.renew()

    def _owned_entries(self) -> list[tuple[str, str]]:
        flights = [*self.inflight.values(), *self._finishing.values()]
        return [(flight.stream, flight.entry_id) for flight in flights]

    def _take_over_abandoned(self) -> None:
        lease_ms = int(self.settings.lease_s * 1000)
        self._ensure_groups(self.tenant_streams.learn(
            self.client.smembers(self.keys.tenants(self.settings.model_name))))
        for stream in [*self.streams, *self.replica_streams.peer_streams()]:
            entries, gone = self.replica_streams.claim_abandoned(stream, lease_ms,
                                                                 self.engine.config.max_num_seqs)
            if gone:
                self.log.warning("pending_entries_gone", stream=stream, count=len(gone))
            for entry_id, fields in entries:
                entry_id = entry_id.decode()
                pending = self.client.xpending_range(stream, CONSUMER_GROUP, entry_id, entry_id, 1)
                deliveries = pending[0]["times_delivered"] if pending else 1
                self.log.info("entry_taken_over", stream=stream, entry_id=entry_id, deliveries=deliveries)
                self._admit_entries([(stream, entry_id, fields, deliveries)])

    def _check_cancel_keys_and_deadlines(self) -> None:
        """Catch cancellations whose pub/sub message was missed, and expire queued requests."""
        if not self.inflight:
            return
        req_ids = list(self.inflight)
        flags = get_many(self.client, [self.keys.cancelled(r) for r in req_ids])
        now = time.time()
        for req_id, flag in zip(req_ids, flags, strict=True):
            deadline = self.inflight[req_id].deadline
            if flag is not None:
                self._abort(req_id)
            elif deadline is not None and now > deadline:
                # (The engine's request says whether it made tokens: what was sent is the
                # publisher's, in another process.)
                request = self.engine.scheduler.get_request(req_id)
                if request is not None and request.status is RequestStatus.WAITING \
                        and not request.output_token_ids:
                    self._expire(req_id)

    # -- cancellation ---------------------------------------------------------------------

    def _listen_for_cancels(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                client = connect(self.redis_url, socket_connect_timeout=5)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.keys.cancel_channel)
                while not stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None:
                        with self._cancel_lock:
                            self._cancel_ids.add(message["data"].decode())
            except Exception as exc:
                if not redis_away(exc):
                    raise
                stop.wait(0.5)  # reconnect; _check_cancel_keys_and_deadlines covers the gap

    def _apply_cancellations(self) -> None:
        with self._cancel_lock:
            cancel_ids, self._cancel_ids = self._cancel_ids, set()
        for req_id in cancel_ids:
            if req_id in self.inflight:
                self._abort(req_id)

    def _abort(self, req_id: str) -> None:
        """Cancel a request now: its blocks are freed at once, its end is written next step."""
        self.engine.abort(req_id)
        self.log.info("request_aborted", req_id=req_id, state="cancelled")

    def _expire(self, req_id: str) -> None:
        """A request whose deadline passed while it waited, before any token, ends as one that
        expired before it was read (and as the gateway ends an unclaimed one): record and event
        both say expired (an ErrorEvent), so the request's GET and its events agree. Written now;
        the engine's abort report comes next step and is moot."""
        flight = self.inflight.pop(req_id)
        self.engine.abort(req_id)
        self._finishing[req_id] = flight  # its entry stays ours until the write lands
        self._finish_unrun(flight, "expired", "expired", EXPIRED_MESSAGE)
        self.log.info("request_expired", req_id=req_id)
