"""`tokenfleet batch submit | status | cancel | results | ingester`: batch jobs from a terminal.

They talk to Redis directly (the same entry any Redis client could write), at `--redis-url`,
else the Redis of the fleet `tokenfleet up` recorded in $TOKENFLEET_HOME/fleet.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis

from gateway.batch.jobs import TERMINAL_JOB_STATES, Job, JobStore, new_job_id
from shared.errors import InvalidRequestError, TokenfleetError
from shared.keys import Keys
from tokenfleet.up import recorded_fleet

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
BAR_WIDTH = 30


def redis_url_from(flag: str | None) -> str:
    """The flag, else the running fleet's Redis (fleet.json), else the default."""
    return flag or recorded_fleet().get("redis_url") or DEFAULT_REDIS_URL


def progress_line(job: Job) -> str:
    total = job.total
    done = job.num_written
    filled = int(BAR_WIDTH * done / total) if total else 0
    counts = job.to_openai()["request_counts"]
    return (f"{job.id} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} "
            f"completed {counts['completed']} failed {counts['failed']}  {job.status}")


class BatchCommands:
    def __init__(self, redis_url: str, key_prefix: str = "tf:") -> None:
        self.client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5)
        self.jobs = JobStore(self.client, Keys(key_prefix))

    async def close(self) -> None:
        await self.client.aclose()

    async def _job(self, job_id: str) -> Job:
        job = await self.jobs.get(job_id)
        if job is None:
            raise InvalidRequestError(f"no batch job {job_id!r}", param="job")
        return job

    async def submit(self, path: str, *, model: str | None, endpoint: str | None, job_id: str | None,
                     window: str, metadata: str | None, wait: bool, output: str | None) -> int:
        try:
            lines = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read {path}: {exc}", param="file") from None
        fields: dict[str, object] = {"lines": lines, "completion_window": window}
        for name, value in (("model", model), ("endpoint", endpoint), ("metadata", metadata)):
            if value is not None:
                fields[name] = value
        job_id = job_id or new_job_id()
        try:
            await self.jobs.create(job_id, fields)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="job-id") from None
        print(job_id, flush=True)
        if not wait:
            return 0
        job = await self.follow(job_id)
        if output is not None:
            await self.results(job_id, output)
        return 0 if job.status == "completed" else 1

    async def follow(self, job_id: str, poll_s: float = 0.5) -> Job:
        """A live progress bar (one rewritten line on a terminal, a line per change otherwise)."""
        tty = sys.stderr.isatty()
        last = None
        while True:
            job = await self._job(job_id)
            line = progress_line(job)
            if line != last:
                print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
                last = line
            if job.status in TERMINAL_JOB_STATES:
                if tty:
                    print(file=sys.stderr)
                errors = job.to_openai()["errors"]
                for error in (errors or {}).get("data", []):
                    print(f"error: {error['message']}", file=sys.stderr)
                return job
            await asyncio.sleep(poll_s)

    async def status(self, job_id: str) -> int:
        print(json.dumps((await self._job(job_id)).to_openai(), indent=2))
        return 0

    async def cancel(self, job_id: str) -> int:
        job = await self._job(job_id)
        if not await self.jobs.stop(job_id, "cancelled") and (await self._job(job_id)).ending != "cancelled":
            raise InvalidRequestError(f"batch job {job_id!r} is {job.status}; it cannot be cancelled now",
                                      param="job")
        print(json.dumps((await self._job(job_id)).to_openai(), indent=2))
        return 0

    async def results(self, job_id: str, output: str | None) -> int:
        await self._job(job_id)
        lines = await self.jobs.outputs(job_id)
        text = "".join(line + "\n" for line in lines)
        if output is None:
            sys.stdout.write(text)
        else:
            Path(output).write_text(text)
            print(f"{len(lines)} lines -> {output}", file=sys.stderr)
        return 0


def run_batch_command(args) -> int:
    action = args.batch_command
    if action == "ingester":
        return _run_ingester(args)

    async def go() -> int:
        commands = BatchCommands(redis_url_from(args.redis_url), args.key_prefix)
        try:
            if action == "submit":
                return await commands.submit(args.file, model=args.model, endpoint=args.endpoint,
                                             job_id=args.job_id, window=args.completion_window,
                                             metadata=args.metadata, wait=args.wait, output=args.output)
            if action == "status":
                return await commands.status(args.job)
            if action == "cancel":
                return await commands.cancel(args.job)
            return await commands.results(args.job, args.output)
        except (OSError, aioredis.ConnectionError) as exc:
            raise TokenfleetError(f"cannot reach Redis: {exc}") from None
        finally:
            await commands.close()

    return asyncio.run(go())


def _run_ingester(args) -> int:
    import signal

    from gateway.batch.ingester import BatchIngester
    from gateway.models import ModelRegistry
    from gateway.settings import GatewaySettings, ModelSpec
    from gateway.tenants import TenantDirectory

    specs = [ModelSpec.from_path(path) for path in args.model_paths]
    tenants = TenantDirectory.from_file(args.tenants_file) if args.tenants_file else TenantDirectory.empty()
    settings = GatewaySettings(redis_url=redis_url_from(args.redis_url), models=specs,
                               key_prefix=args.key_prefix, batch_max_inflight=args.max_inflight,
                               batch_lease_s=args.lease_s, tenants=tenants,
                               tenants_from_redis=args.tenants_from_redis)

    async def go() -> int:
        models = await asyncio.to_thread(ModelRegistry.load, specs)
        client = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=5, socket_timeout=30)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await BatchIngester(client, Keys(args.key_prefix), models, settings).run(stop)
        finally:
            await client.aclose()
        return 0

    started = time.monotonic()
    code = asyncio.run(go())
    print(f"batch ingester stopped after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return code
