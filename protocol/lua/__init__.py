"""The fleet's Lua scripts, one `<name>.lua` file each with its KEYS and ARGV named in a header
comment, the one loader that reads them, and the one way they are called.

Every script is cluster-safe: the keys it touches are passed in KEYS (never built inside Lua)
and share one hash slot (a request's partition tag, protocol/keys.py), so Redis Cluster runs it
on one shard. A script that publishes says `{PUBLISH}`: PUBLISH on one server, SPUBLISH (sharded
pub/sub, on the slot of the script's keys) on a cluster (`Script(..., sharded=True)`).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from importlib import resources

from redis.exceptions import NoScriptError

Call = tuple[Sequence[object], Sequence[object]]  # (KEYS, ARGV) of one call


@functools.cache
def _source(name: str) -> str:
    return resources.files(__name__).joinpath(f"{name}.lua").read_text()


def load(name: str, **values: str) -> str:
    """The script `name`, its `{PLACEHOLDER}`s filled in (a constant shared with Python, such as
    the consumer group's name, is written once, in Python)."""
    source = _source(name)
    for key, value in values.items():
        source = source.replace("{" + key + "}", value)
    left = re.findall(r"\{[A-Z_]+\}", source)
    if left:
        raise ValueError(f"{name}.lua has placeholders left unfilled: {left}")
    return source


class Script:
    """One loaded script, called by its sha in pipelines (one round trip for many calls, split by
    node on a cluster); a Redis that lacks it (restarted, failed over) gets it loaded and only
    the calls it refused are sent again (a refused EVALSHA did nothing)."""

    def __init__(self, name: str, *, sharded: bool = False, **values: str) -> None:
        if "PUBLISH" in _source(name):
            values.setdefault("PUBLISH", "SPUBLISH" if sharded else "PUBLISH")
        self.name = name
        self.source = load(name, **values)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def _queue(self, pipe, calls: dict[int, Call]) -> None:
        for keys, args in calls.values():
            # (execute_command: redis-py's cluster pipeline refuses its evalsha() method, not the command)
            pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def _sort(self, calls: dict[int, Call], replies: list, out: list) -> dict[int, Call]:
        refused = {}
        for (i, call), reply in zip(calls.items(), replies, strict=True):
            if isinstance(reply, NoScriptError):
                refused[i] = call
            elif isinstance(reply, Exception):
                raise reply
            else:
                out[i] = reply
        return refused

    def run_many(self, client, calls: Sequence[Call]) -> list:
        """Each call's reply, in order (sync client: a single server's or a cluster's)."""
        if len(calls) == 1:  # (one call: a plain command, cheaper than a pipeline of one)
            return [self.run(client, *calls[0])]
        out: list = [None] * len(calls)
        todo = dict(enumerate(calls))
        while todo:
            pipe = client.pipeline(transaction=False)
            self._queue(pipe, todo)
            todo = self._sort(todo, pipe.execute(raise_on_error=False), out)
            if todo:
                client.script_load(self.source)  # (a cluster loads it on every primary)
        return out

    def run(self, client, keys: Sequence[object], args: Sequence[object]):
        try:
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    async def run_many_async(self, client, calls: Sequence[Call]) -> list:
        """run_many for an asyncio client."""
        if len(calls) == 1:
            return [await self.run_async(client, *calls[0])]
        out: list = [None] * len(calls)
        todo = dict(enumerate(calls))
        while todo:
            pipe = client.pipeline(transaction=False)
            self._queue(pipe, todo)
            todo = self._sort(todo, await pipe.execute(raise_on_error=False), out)
            if todo:
                await client.script_load(self.source)
        return out

    async def run_async(self, client, keys: Sequence[object], args: Sequence[object]):
        try:
            return await client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
