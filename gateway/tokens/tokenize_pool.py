"""Where a gateway process renders chat templates and tokenizes prompts: one thread of its own,
never the event loop.

Tokenizing the chat template's text took 53% of a gateway worker's busy time on the H200
workload (py-spy, issue 27); on the loop it stalled every stream the process held. The Rust
tokenizer releases the GIL while it encodes, so the loop runs meanwhile; the template's Jinja
rendering holds the GIL but yields it at each switch interval. One thread, not several: a fast
tokenizer refuses to be used from two threads at once ("Already borrowed") when a call changes
its truncation settings, and one thread keeps up with a process's share of the requests.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from aiohttp import web

T = TypeVar("T")

THREAD_NAME = "tokenize"


class TokenizePool:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) on the tokenizing thread; its exceptions (a BadRequest) propagate."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# The app's key of this process's one TokenizePool (opened in gateway/http/app.py's cleanup_ctx).
TOKENIZE = web.AppKey("tokenize", TokenizePool)  # chat templates and tokenizers, off the event loop
