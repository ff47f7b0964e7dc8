"""What a test needs on the client side of the queue: submit, watch events, wait for ends.

Written against Redis directly (not through tokenfleet's service code) so the tests judge
the service from the outside."""

from __future__ import annotations

import threading
import time
import uuid

import redis

from protocol.keys import Keys
from protocol.messages import RequestMessage, decode_event, unpack_list_chunks
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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pubsub.close()
