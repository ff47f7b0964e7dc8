"""The chaos harness's clients (testkit/chaos/harness.py): each kind of caller the fleet serves, written
to keep going while processes die under it, and to record what it saw for the checks.

- stream: an OpenAI SSE completion read to `[DONE]`; a stream cut by a dying gateway is kept
  as `broken` (its request may end cancelled: a gateway shutting down cancels what it serves).
- resume: POST /v1/requests, then GET .../events, leaving on purpose after a few events and
  coming back with Last-Event-ID, and again after any error, until the final event.
- poll: POST /v1/requests, then GET /v1/requests/{id} until it ends.
- cancel: POST /v1/requests, DELETE it a moment later.
- disconnect: an SSE completion dropped after its first chunk (the gateway cancels it).

Every POST /v1/requests carries an Idempotency-Key and is retried until it is answered, so a
request is accepted once however often the front door falls over.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

from testkit.sse import DONE, data_lines

KINDS = ("stream", "resume", "poll", "cancel", "disconnect")
TERMINAL = ("completed", "failed", "cancelled", "expired")
RETRY_STATUSES = (429, 500, 502, 503, 504)


@dataclass
class Outcome:
    kind: str
    prompt_index: int
    req_id: str | None = None  # set once the fleet accepted the request
    text: str = ""  # what an SSE completion client saw
    seqs: list[int] = field(default_factory=list)  # event sequence numbers, across reconnects
    token_ids: list[int] = field(default_factory=list)  # from the events
    num_final_events: int = 0
    is_done: bool = False  # the client saw the end ([DONE], the final event, a terminal status)
    is_broken: bool = False  # a stream cut short by the fleet
    num_reconnects: int = 0  # event streams opened again with Last-Event-ID
    errors: list[str] = field(default_factory=list)


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, prompts: list[list[int]],
                 max_tokens: list[int], deadline_s: float = 300.0) -> None:
        self.session = session
        self.url = url
        self.model = model
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s  # how long one call keeps retrying

    def body(self, index: int, **extra) -> dict:
        return {"model": self.model, "prompt": self.prompts[index], "max_tokens": self.max_tokens[index],
                "temperature": 0, "ignore_eos": True, **extra}

    async def run(self, kind: str, index: int, rng: random.Random) -> Outcome:
        out = Outcome(kind, index)
        try:
            if kind in ("stream", "disconnect"):
                await self._stream(out, drop_after_first=kind == "disconnect")
            else:
                await self._submit(out)
                if kind == "resume":
                    await self._follow(out, rng)
                elif kind == "poll":
                    await self.wait_status(out.req_id)
                    out.is_done = True
                elif kind == "cancel":
                    await asyncio.sleep(rng.uniform(0.0, 0.5))
                    await self._retrying("DELETE", f"/v1/requests/{out.req_id}")
        except Exception as exc:  # noqa: BLE001 - recorded; the checks judge it
            out.errors.append(f"{type(exc).__name__}: {exc}")
        return out

    async def _retrying(self, method: str, path: str, **kwargs) -> tuple[int, dict]:
        """Until an answer that is not 5xx/429 nor a connection error, or deadline_s."""
        deadline = time.monotonic() + self.deadline_s
        delay = 0.2
        while True:
            try:
                async with self.session.request(method, self.url + path, **kwargs) as response:
                    if response.status not in RETRY_STATUSES:
                        return response.status, await response.json(content_type=None)
                    problem = f"HTTP {response.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
                problem = repr(exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{method} {path}: no answer within {self.deadline_s:.0f} s ({problem})")
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 1.5)

    async def _submit(self, out: Outcome) -> None:
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        status, view = await self._retrying("POST", "/v1/requests", headers=headers,
                                            json={"kind": "completion", **self.body(out.prompt_index)})
        if status != 202:
            raise RuntimeError(f"POST /v1/requests answered {status}: {view}")
        out.req_id = view["id"]

    async def wait_status(self, req_id: str, timeout_s: float | None = None) -> dict:
        """GET /v1/requests/{id} until it ends; its view."""
        deadline = time.monotonic() + (timeout_s or self.deadline_s)
        while True:
            status, view = await self._retrying("GET", f"/v1/requests/{req_id}")
            if status != 200:
                raise RuntimeError(f"GET /v1/requests/{req_id} answered {status}: {view}")
            if view["status"] in TERMINAL:
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {req_id} still {view['status']} after {timeout_s} s")
            await asyncio.sleep(0.25)

    async def _stream(self, out: Outcome, *, drop_after_first: bool) -> None:
        deadline = time.monotonic() + self.deadline_s
        while out.req_id is None:  # not accepted yet: the POST may be tried again
            try:
                async with self.session.post(self.url + "/v1/completions",
                                             json=self.body(out.prompt_index, stream=True)) as response:
                    if response.status in RETRY_STATUSES:
                        raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
                    if response.status != 200:
                        raise RuntimeError(f"stream answered {response.status}: {await response.text()}")
                    async for _, data in data_lines(response.content):
                        if data == DONE:
                            out.is_done = True
                            return
                        chunk = json.loads(data)
                        if "error" in chunk:
                            out.errors.append(f"error chunk: {chunk['error']}")
                            continue
                        out.req_id = chunk["id"].removeprefix("cmpl-")
                        out.text += chunk["choices"][0].get("text") or ""
                        if drop_after_first and out.text:
                            return  # leaving the connection cancels the request
                    out.is_broken = out.req_id is not None  # ended without [DONE]
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if out.req_id is not None:  # accepted, then cut: the request runs on without us
                    out.is_broken = True
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no stream within {self.deadline_s:.0f} s ({exc!r})") from None
                await asyncio.sleep(0.5)

    async def _follow(self, out: Outcome, rng: random.Random) -> None:
        """The event stream, resumed with Last-Event-ID after every cut, ours or the fleet's."""
        deadline = time.monotonic() + self.deadline_s
        leave_after = rng.choice([None, 1, 2, 3, 5])  # events read before leaving on purpose
        while not out.is_done:
            last = out.seqs[-1] if out.seqs else 0
            try:
                async with self.session.get(f"{self.url}/v1/requests/{out.req_id}/events",
                                            headers={"Last-Event-ID": str(last)}) as response:
                    if response.status != 200:
                        raise aiohttp.ClientResponseError(response.request_info, (), status=response.status,
                                                          message=await response.text())
                    out.num_reconnects += last > 0
                    read = await self._read_events(response, out, leave_after)
                    leave_after = None if read else leave_after
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                if isinstance(exc, aiohttp.ClientResponseError) and exc.status == 404:
                    raise RuntimeError(f"request {out.req_id} is unknown: {exc.message}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"events of {out.req_id} did not end within {self.deadline_s:.0f} s "
                                       f"({exc!r})") from None
                await asyncio.sleep(0.3)

    @staticmethod
    async def _read_events(response: aiohttp.ClientResponse, out: Outcome, leave_after: int | None) -> bool:
        """Events until the end, or until leave_after events were read (True: it left on purpose)."""
        num_read = 0
        event = None
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if event == "done":
                    out.is_done = True
                    return False
                data = json.loads(line[6:])
                out.seqs.append(data["seq"])
                out.token_ids.extend(data.get("token_ids") or [])
                if data.get("status") in TERMINAL:
                    out.num_final_events += 1
                num_read += 1
                if leave_after is not None and num_read >= leave_after:
                    return True
            elif not line:
                event = None
        return False
