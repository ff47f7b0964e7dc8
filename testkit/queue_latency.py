"""How long a chat takes from its POST to its queue entry, through a real gateway on a real
Redis with no scheduler: a heartbeat hash stands in for one (the gateway admits the model),
a listener process timestamps each entry as Redis hands it out (a blocking XREAD, its own
process: its clock costs the client nothing), and the client leaves once the response's
headers came (the gateway then cancels the request, which removes its entry).

Also the same steps timed one by one inside a gateway app of this process (no HTTP), on the
same Redis: what each of chat_completions' steps before the XADD costs (gateway/api/openai/api.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import random
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import redis

from protocol import registry
from protocol.keys import Keys
from protocol.messages import RequestMessage
from shared.redis_client import connect_node

REQUEST_IDS_HEADER = "tokenfleet-request-id"
STEPS = ("validate body", "plan_chat (thread)", "admit", "following (SUBSCRIBE)", "submit")
WORDS = ("the of and to in is was for on that with as by at from his her an were are which this be had or "
         "not but what all when we there can been has more if no one out so said who would them some could "
         "time very about than then into only over think also back after use two how our work first well "
         "way even new want because any these give day most river stone garden engine quiet bright window "
         "under market yellow silver number ocean letter winter summer 42 7 1999 café naïve 東京 🚀").split()


def words(rng: random.Random, count: int) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(count))
    return text[0].upper() + text[1:] + "."


def chat_bodies(model: str, num: int, *, system_words: int = 800, seed: int = 0) -> list[bytes]:
    """Chats sharing one system prompt of system_words words, each with a user turn of its own
    (40-300 words), streamed: the issue 27 workload's shape."""
    import json

    rng = random.Random(seed)
    system = words(rng, system_words)
    return [json.dumps({"model": model, "stream": True, "max_tokens": 16, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": words(rng, rng.randint(40, 300))}]}).encode() for _ in range(num)]


def fake_heartbeat(client: redis.Redis, keys: Keys, model: str) -> None:
    """A scheduler's heartbeat hash (gateway/fleet/tracker.py reads it): the gateway then serves the model."""
    client.hset(keys.scheduler("bench-queue-1"), mapping={"model": model, "updated_at": time.time(),
                                                          "max_num_seqs": 256})
    registry.beat(client, keys, registry.SCHEDULERS, "bench-queue-1", 24 * 3600)


def _listen(port: int, stream: str, out_path: str, ready, stop) -> None:
    client = connect_node("127.0.0.1", port)
    seen: list[tuple[str, float]] = []
    last = "$"
    ready.set()
    while not stop.is_set():
        for _, entries in client.xread({stream: last}, block=200) or []:
            now = time.time()
            for entry_id, fields in entries:
                last = entry_id
                seen.append((RequestMessage.decode(fields[b"m"]).req_id, now))
    Path(out_path).write_bytes(pickle.dumps(seen))


class EntryListener:
    """A process timestamping (time.time()) each entry XADDed to a stream: {req_id: when}."""

    def __init__(self, redis_port: int, stream: str, out_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready, self.stop, self.out_path = ctx.Event(), ctx.Event(), out_path
        self.process = ctx.Process(target=_listen, args=(redis_port, stream, str(out_path), self.ready,
                                                         self.stop), daemon=True)

    def __enter__(self) -> EntryListener:
        self.process.start()
        if not self.ready.wait(30):
            raise RuntimeError("the stream listener did not start")
        time.sleep(0.3)  # its first XREAD is on its way
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.process.join(10)

    def entries(self) -> dict[str, float]:
        return dict(pickle.loads(self.out_path.read_bytes()))


async def post_chats(url: str, bodies: list[bytes], interval_s: float) -> dict[str, float]:
    """POST each chat in turn (one at a time, interval_s apart): {req_id: time.time() before its POST}."""
    posted = {}
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            start = time.time()
            async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as response:
                if response.status != 200:
                    raise RuntimeError(f"POST answered {response.status}: {await response.text()}")
                posted[response.headers[REQUEST_IDS_HEADER]] = start
            await asyncio.sleep(interval_s)
    return posted


async def step_times(settings, bodies: list[bytes], tenant=None) -> dict[str, list[float]]:
    """Each step of chat_completions before the XADD, timed alone (seconds) in a gateway app of
    this process, for each body, as the caller `tenant` (a gateway.tenants.directory.Tenant) if given;
    the requests are cancelled right after."""
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from gateway.api.openai.params import plan_chat
    from gateway.api.openai.schemas import ChatCompletionRequest
    from gateway.core.appkeys import SETTINGS
    from gateway.http.app import create_app
    from gateway.serving.handlers import admit, admit_tenant, following, new_req_id, submissions
    from gateway.serving.store import STORE
    from gateway.tenants.limits import LIMITER
    from gateway.tokens.models import MODELS
    from gateway.tokens.tokenize_pool import TOKENIZE

    app = create_app(settings)
    runner = web.AppRunner(app)
    await runner.setup()
    times: dict[str, list[float]] = defaultdict(list)

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        times[name].append(now - since)
        return now

    try:
        for raw in bodies:
            request = make_mocked_request("POST", "/v1/chat/completions", app=app)
            if tenant is not None:
                request["tenant"] = tenant
            t = time.perf_counter()
            body = ChatCompletionRequest.model_validate_json(raw)
            t = lap("validate body", t)
            model = app[MODELS].get(body.model)
            plan = await app[TOKENIZE].run(plan_chat, body, model, app[SETTINGS])
            t = lap("plan_chat (thread)", t)
            await admit(request, model.name, 1)
            req_ids = [new_req_id()]
            tenant = await admit_tenant(request, plan, req_ids)
            t = lap("admit", t)
            lease_until = app[LIMITER].lease_for_queue(tenant) if tenant is not None else None
            async with following(request, model, req_ids):
                t = lap("following (SUBSCRIBE)", t)
                queued = submissions(plan, req_ids, tenant=tenant, lease_until=lease_until)
                await app[STORE].submit(queued)
                lap("submit", t)
            if tenant is not None:
                await app[LIMITER].release(tenant.name, req_ids)
            times["total"].append(sum(times[name][-1] for name in STEPS))
            await asyncio.sleep(0.005)  # the cancel goes out
    finally:
        await runner.cleanup()
    return times
