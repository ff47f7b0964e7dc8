"""Fire-and-forget work that must still finish (a cancel sent as a client leaves)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

from shared.logging import get_logger

log = get_logger("tokenfleet.gateway.tasks")


class TaskSet:
    """Holds a reference to every task it starts; on close, waits a little, then cancels."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background_task_failed", task=task.get_name(), error=repr(task.exception()))

    async def close(self, timeout_s: float = 5.0) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
