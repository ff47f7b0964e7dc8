"""What a test needs on the client side of the queue: submit, watch events, wait for ends.

Written against Redis directly (not through tokenfleet's service code) so the tests judge
the service from the outside."""

from __future__ import annotations

import threading
import time
import uuid

import redis

from protocol.keys import Keys
from protocol.messages import ErrorEvent, RequestMessage, decode_event, unpack_list_chunks
from shared.sampling import SamplingParams

KEYS = Keys()
TERMINAL = {b"completed", b"failed", b"cancelled", b"expired"}


def submit(client: redis.Redis, model: str, prompt: list[int], sampling: SamplingParams, *,
           kind: str = "interactive", req_id: str | None = None, stream: str | None = None, **extra) -> str:
    """Queue a request as the gateway does, in the model's stream of its kind (or in `stream`:
    a scheduler's own, as the gateway routes one)."""
    req_id = req_id or uuid.uuid4().hex
    message = RequestMessage.make(req_id, model, prompt, sampling, kind=kind, arrival_time=time.time(),
                                  **extra)
    if message.tenant is not None:  # as the gateway queues a tenant's request
        client.sadd(KEYS.tenants(model), message.tenant)
    client.xadd(stream or KEYS.request_stream(model, kind, message.tenant), {"m": message.encode()})
    return req_id


def wait_terminal(client: redis.Redis, req_ids: list[str], timeout_s: float = 300) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = {r: client.hgetall(KEYS.result(r)) for r in req_ids}
        if all(rec.get(b"state") in TERMINAL for rec in records.values()):
            return records
        if time.monotonic() > deadline:
            states = {r: rec.get(b"state") for r, rec in records.items()}
            raise TimeoutError(f"not all requests ended: {states}")
        time.sleep(0.05)


def token_ids(record: dict) -> list[int]:
    return unpack_list_chunks(record[b"token_ids"]) if b"token_ids" in record else []


class EventRecorder:
    """Every event published on tf:ev:* while it runs, per request, in arrival order."""

    def __init__(self, url: str) -> None:
        self.events: dict[str, list] = {}
        self._pubsub = redis.Redis.from_url(url).pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe(KEYS.events("*"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.2)
            if message is not None:
                event = decode_event(message["data"])
                self.events.setdefault(event.req_id, []).append(event)

    def wait_until(self, is_done, timeout_s: float = 60) -> None:
        """Until is_done(events) holds: a published event reaches this thread when the machine
        gets to it (on a loaded one, much later than it was published)."""
        deadline = time.monotonic() + timeout_s
        while not is_done(self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the recorder did not get the events awaited: {dict(self.events)}")
            time.sleep(0.02)

    def wait_for_end(self, req_id: str, timeout_s: float = 60) -> None:
        """Until the request's last event (its finish, or an error) has been received."""
        self.wait_until(lambda events: any(isinstance(e, ErrorEvent) or e.finish_reason is not None
                                           for e in events.get(req_id, [])), timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()
