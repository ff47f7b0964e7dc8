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

from gateway.api.batch.entry import JobRefused, check_entry
from gateway.api.batch.jobs import TERMINAL_JOB_STATES, Job, JobStore, new_job_id
from gateway.api.batch.lines import endpoint_mismatch
from protocol.keys import keys_for
from shared.errors import InvalidRequestError, TokenfleetError
from shared.redis_client import connect_async
from tokenfleet.up import recorded_redis_url

BAR_WIDTH = 30


def progress_line(batch: dict) -> str:
    """One line for a job's OpenAI Batch object (what a corrupt record shows too)."""
    counts = batch["request_counts"]
    total, done = counts["total"], counts["completed"] + counts["failed"]
    filled = min(BAR_WIDTH, int(BAR_WIDTH * done / total)) if total else 0
    return (f"{batch['id']} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total} "
            f"completed {counts['completed']} failed {counts['failed']}  {batch['status']}")


def check_submission(fields: dict[str, object]) -> None:
    """What the ingester would refuse the job for as a whole, refused here instead, before
    anything is written: a bad field, or (with --endpoint) a line for another endpoint."""
    try:
        check_entry(fields, {k: v for k, v in fields.items() if k != "lines" and isinstance(v, str)})
    except JobRefused as exc:
        flag = {"completion_window": "completion-window"}.get(exc.error["param"], exc.error["param"])
        raise InvalidRequestError(exc.error["message"], param=flag) from None
    endpoint = fields.get("endpoint")
    if endpoint is not None:
        mismatch = endpoint_mismatch(str(fields["lines"]), str(endpoint))
        if mismatch is not None:
            raise InvalidRequestError(f"{mismatch.message} (--endpoint {endpoint})", param="endpoint")


class BatchCommands:
    def __init__(self, redis_url: str, key_prefix: str = "tf:") -> None:
        self.client = connect_async(redis_url, socket_connect_timeout=5)
        self.jobs = JobStore(self.client, keys_for(redis_url, key_prefix))

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
        check_submission(fields)
        job_id = job_id or new_job_id()
        try:
            await self.jobs.create(job_id, fields)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="job-id") from None
        print(job_id, flush=True)
        if not wait:
            return 0
        batch = await self.follow(job_id)
        if output is not None:
            await self.results(job_id, output)
        return 0 if batch["status"] == "completed" else 1

    async def follow(self, job_id: str, poll_s: float = 0.5) -> dict:
        """A live progress bar (one rewritten line on a terminal, a line per change otherwise)."""
        tty = sys.stderr.isatty()
        last = None
        while True:
            batch = (await self._job(job_id)).to_openai()
            line = progress_line(batch)
            if line != last:
                print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
                last = line
            if batch["status"] in TERMINAL_JOB_STATES:
                if tty:
                    print(file=sys.stderr)
                for error in (batch["errors"] or {}).get("data", []):
                    print(f"error: {error['message']}", file=sys.stderr)
                return batch
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

    async def go() -> int:
        commands = BatchCommands(args.redis_url or recorded_redis_url(), args.key_prefix)
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


def run_ingester(settings) -> int:
    """`tokenfleet batch ingester`: a BatchIngester alone, with the settings its flags made
    (tokenfleet/cli.py's ingester_settings, from the same flags as the gateway's own ingester)."""
    import signal

    from gateway.api.batch.ingester import BatchIngester
    from gateway.tokens.models import ModelRegistry

    async def go() -> int:
        models = await asyncio.to_thread(ModelRegistry.load, settings.models)
        client = connect_async(settings.redis_url, socket_connect_timeout=5, socket_timeout=30)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            keys = keys_for(settings.redis_url, settings.key_prefix)
            await BatchIngester(client, keys, models, settings).run(stop)
        finally:
            await client.aclose()
        return 0

    started = time.monotonic()
    code = asyncio.run(go())
    print(f"batch ingester stopped after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return code
