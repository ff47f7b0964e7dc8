"""Background work of a gateway process: fire-and-forget work that must still finish (a cancel
sent as a client leaves), and work repeated every few seconds until the app stops."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

from redis.exceptions import RedisError

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


async def every(interval_s: float, stop: asyncio.Event, work: Callable[[], Awaitable[None]],
                failure_event: str) -> None:
    """Await work() every interval_s until stop is set. Redis being away is logged as
    `failure_event` and tried again next time. (Cancelling alone is not enough to stop it:
    redis-py may turn a cancellation in the middle of a command into a ConnectionError.)"""
    while not stop.is_set():
        try:
            await work()
        except (RedisError, OSError) as exc:
            if stop.is_set():
                break
            log.warning(failure_event, error=str(exc))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


@contextlib.asynccontextmanager
async def running_until_stopped(run: Callable[[asyncio.Event], Awaitable[None]],
                                name: str) -> AsyncIterator[None]:
    """`run(stop)` as a task for the length of the block; then stop is set and the task ended."""
    stop = asyncio.Event()
    task = asyncio.create_task(run(stop), name=name)
    try:
        yield
    finally:
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
