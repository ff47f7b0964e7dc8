"""A stand-in scheduler for the gateway's fast tests: it speaks the real Redis contract
(consumer group, claim, the fenced ResultStore write that mirrors and publishes, heartbeats,
cancellation) but "generates" a fixed reply, one token per event, without a model.

It also writes the proposed `offsets` field (see gateway/serving/records.py), unless told not to.
"""

from __future__ import annotations

import threading
import time

import msgpack
import redis

from protocol import registry
from protocol.keys import CONSUMER_GROUP, Keys
from protocol.messages import TERMINAL_STATES, RequestMessage, TokenEvent
from protocol.result_record import progress_fields, running_fields, terminal_fields
from service.result_store import ResultStore, ResultUpdate

REPLY = "The quick brown fox jumps over the lazy dog, again and again and again."


class FakeScheduler:
    def __init__(self, url: str, model: str, tokenizer, *, scheduler_id: str = "fake-1",
                 token_delay_s: float = 0.0, consume: bool = True, write_offsets: bool = True,
                 max_reply_tokens: int | None = None, kinds: tuple[str, ...] = ("interactive",),
                 stop_after_reply: bool = False) -> None:
        self.client = redis.Redis.from_url(url)
        self.keys = Keys()
        self.model = model
        self.scheduler_id = scheduler_id
        self.reply_ids = tokenizer(REPLY, add_special_tokens=False).input_ids
        self.tokenizer = tokenizer
        self.token_delay_s = token_delay_s
        self.consume = consume
        self.write_offsets = write_offsets
        self.max_reply_tokens = max_reply_tokens  # ends longer requests early, as "length"
        self.results = ResultStore(self.client, self.keys, scheduler_id, 600)
        self.stream = self.keys.request_stream(model, "interactive")
        self.stop_after_reply = stop_after_reply  # the reply once, ending "stop" (else repeated, "length")
        self.kinds = kinds  # ("interactive", "batch") serves batch lines too, as a real scheduler does
        self.seen: list[RequestMessage] = []  # every request taken, in order
        self.cancelled: list[str] = []  # requests it stopped because of a cancel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeScheduler:
        for kind in self.kinds:
            try:
                self.client.xgroup_create(self.keys.request_stream(self.model, kind), CONSUMER_GROUP, id="0",
                                          mkstream=True)
            except redis.ResponseError:
                pass
        self._heartbeat()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            registry.leave(self.client, self.keys, registry.SCHEDULERS, self.scheduler_id)
            self.client.delete(self.keys.scheduler(self.scheduler_id))
        except redis.ConnectionError:
            pass

    def _heartbeat(self) -> None:
        key = self.keys.scheduler(self.scheduler_id)
        self.client.hset(key, mapping={"model": self.model, "num_running": 0, "num_waiting": 0,
                                       "kv_usage": 0.0, "max_num_seqs": 8, "updated_at": time.time()})
        self.client.expire(key, 3)
        registry.beat(self.client, self.keys, registry.SCHEDULERS, self.scheduler_id, 3)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._loop()
            except (redis.ConnectionError, redis.TimeoutError):
                self._stop.wait(0.1)  # Redis restarts in some tests: carry on when it is back
            except redis.ResponseError:
                # Some tests refuse scripts for a moment (ACL -@scripting): the heartbeat's registry
                # script fails then; carry on, as a real scheduler's maintenance does.
                self._stop.wait(0.1)

    def _loop(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if time.monotonic() > next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + 0.5
            if not self.consume:
                self._stop.wait(0.05)
                continue
            response = self.client.xreadgroup(CONSUMER_GROUP, self.scheduler_id,
                                              {s: ">" for s in self._streams()}, count=1, block=50)
            for stream, entries in response or []:
                for entry_id, fields in entries:
                    self._serve(stream.decode(), entry_id.decode(), RequestMessage.decode(fields[b"m"]))

    def _streams(self) -> list[str]:
        """The model's streams and each tenant's (as a real scheduler reads them)."""
        streams = [self.keys.request_stream(self.model, kind) for kind in self.kinds]
        for tenant in sorted(self.client.smembers(self.keys.tenants(self.model))):
            for kind in self.kinds:
                stream = self.keys.request_stream(self.model, kind, tenant.decode())
                try:
                    self.client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
                except redis.ResponseError:
                    pass
                streams.append(stream)
        return streams

    def _is_cancelled(self, req_id: str) -> bool:
        return bool(self.client.exists(self.keys.cancelled(req_id)))

    def _serve(self, stream: str, entry_id: str, message: RequestMessage) -> None:
        self.seen.append(message)
        req_id = message.req_id
        progress = self.results.claim(req_id)
        if progress.state in TERMINAL_STATES:
            self.results.write([ResultUpdate(req_id, stream, {}, ack_entry_id=entry_id)])
            return
        sampling = message.sampling_params()
        prompt = len(message.prompt_token_ids)
        self.results.write([ResultUpdate(req_id, stream, running_fields(
            model=self.model, prompt_tokens=prompt, scheduler=self.scheduler_id))])
        repeats = 1 if self.stop_after_reply else 50
        num_tokens = min(sampling.max_tokens, self.max_reply_tokens or sampling.max_tokens)
        ids = (self.reply_ids * repeats)[:num_tokens]
        tokens: list[int] = []
        text = ""
        logprobs: list = []
        offsets: list = []
        for seq, token_id in enumerate(ids, start=1):
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            finished = seq == len(ids) or self._is_cancelled(req_id)
            aborted = self._is_cancelled(req_id)
            new = [] if aborted else [token_id]
            tokens += new
            delta = self.tokenizer.decode(tokens)[len(text):] if new else ""
            text += delta
            offsets.append([len(tokens), len(text)])
            event_logprobs = None
            if sampling.logprobs is not None and new:
                top = [[token_id, -0.25]] + [[t, -2.0 - i] for i, t in enumerate(range(10, 10 + 20))]
                event_logprobs = [[token_id, -0.25, top[:sampling.logprobs] if sampling.logprobs else None]]
                logprobs += event_logprobs
            # The whole output so far every step (a shape the reader accepts as well as appends).
            fields = progress_fields(seq, text, msgpack.packb(tokens),
                                     msgpack.packb(offsets) if self.write_offsets else None,
                                     first_token_at=time.time() if seq == 1 else None,
                                     logprobs_chunk=msgpack.packb(logprobs) if logprobs else None)
            event = TokenEvent(req_id, seq, new, delta, event_logprobs)
            ack = None
            if finished:
                is_stop = self.stop_after_reply and len(ids) == len(self.reply_ids)
                reason = "abort" if aborted else "stop" if is_stop else "length"
                usage = {"prompt_tokens": prompt, "completion_tokens": len(tokens),
                         "total_tokens": prompt + len(tokens)}
                event.finish_reason, event.usage = reason, usage
                state = "cancelled" if aborted else "completed"
                fields.update(terminal_fields(state, finish_reason=reason, usage=usage))
                ack = entry_id
                if aborted:
                    self.cancelled.append(req_id)
            self.results.write([ResultUpdate(req_id, stream, fields, event.encode(), ack,
                                             batch_job_id=message.batch_job_id if finished else None)])
            if finished:
                return
