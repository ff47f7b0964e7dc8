"""Every Redis key tokenfleet uses, in one place. The prefix (default "tf:") is configurable.

| key                                   | type          | written by              | read by               |
| ------------------------------------- | ------------- | ----------------------- | --------------------- |
| {p}req:{model}:{interactive|batch}    | stream        | gateway, batch ingester | schedulers (group)    |
| {p}ev:{req_id}                        | pub/sub       | scheduler               | gateway               |
| {p}res:{req_id}                       | hash with TTL | scheduler               | gateway, a successor  |
| {p}cancel                             | pub/sub       | gateway                 | schedulers            |
| {p}cancelled:{req_id}                 | string + TTL  | gateway                 | schedulers            |
| {p}sched:{scheduler_id}               | hash with TTL | scheduler (heartbeat)   | gateway, metrics      |
| {p}drain:{scheduler_id}               | string + TTL  | autoscaler              | that scheduler        |
| {p}replicas:{model}                   | hash          | autoscaler              | status, metrics       |
| {p}dead                               | stream        | scheduler               | operators             |
| {p}batch:in                           | stream        | any Redis client        | batch ingesters       |
| {p}batch:{job}                        | hash          | batch ingesters         | clients, CLI, gateway |
| {p}batch:{job}:out                    | stream        | batch ingesters         | clients, CLI, gateway |
| {p}batch:{job}:lines, :staging        | list          | batch ingesters         | batch ingesters       |
| {p}batch:{job}:written                | bitmap        | batch ingesters         | batch ingesters       |
| {p}batch:done                         | stream        | scheduler               | batch ingesters       |
| {p}batch:jobs, {p}batch:active        | zset, set     | batch ingesters         | gateway, ingesters    |
| {p}batch:entry:{entry_id}             | string        | batch ingesters         | clients               |
| {p}file:{file_id}, {p}files           | hash, zset    | gateway (/v1/files)     | gateway, ingesters    |

Request ids are made by the server (never client text), so they are safe inside keys; a job id
a client chooses is checked against JOB_ID_PATTERN before it becomes part of a key.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSUMER_GROUP = "schedulers"
INGESTER_GROUP = "ingesters"  # the batch ingesters' group on tf:batch:in and tf:batch:done
JOB_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
REQUEST_KINDS = ("interactive", "batch")  # read in this order: interactive first


@dataclass(frozen=True)
class Keys:
    prefix: str = "tf:"

    def request_stream(self, model: str, kind: str) -> str:
        if kind not in REQUEST_KINDS:
            raise ValueError(f"request kind {kind!r} is not one of {REQUEST_KINDS}")
        return f"{self.prefix}req:{model}:{kind}"

    def events(self, req_id: str) -> str:
        return f"{self.prefix}ev:{req_id}"

    def result(self, req_id: str) -> str:
        return f"{self.prefix}res:{req_id}"

    @property
    def cancel_channel(self) -> str:
        return f"{self.prefix}cancel"

    def cancelled(self, req_id: str) -> str:
        return f"{self.prefix}cancelled:{req_id}"

    def scheduler(self, scheduler_id: str) -> str:
        return f"{self.prefix}sched:{scheduler_id}"

    @property
    def scheduler_pattern(self) -> str:
        return f"{self.prefix}sched:*"

    def drain(self, scheduler_id: str) -> str:
        """Set (value: a deadline, unix seconds) to ask one scheduler to drain: it reads no new
        entries, finishes what it runs (what is left at the deadline is taken over), then exits."""
        return f"{self.prefix}drain:{scheduler_id}"

    def replicas(self, model: str) -> str:
        """The autoscaler's view of one model: desired, actual, starting, draining, min, max,
        unplaced (placements that timed out), last_event, last_event_at, updated_at."""
        return f"{self.prefix}replicas:{model}"

    @property
    def replicas_pattern(self) -> str:
        return f"{self.prefix}replicas:*"

    @property
    def dead(self) -> str:
        return f"{self.prefix}dead"

    # -- batch jobs ---------------------------------------------------------------------

    @property
    def batch_in(self) -> str:
        return f"{self.prefix}batch:in"

    @property
    def batch_done(self) -> str:
        """Notices of batch items that reached a terminal state (written with that state)."""
        return f"{self.prefix}batch:done"

    @property
    def batch_jobs(self) -> str:
        return f"{self.prefix}batch:jobs"

    @property
    def batch_active(self) -> str:
        return f"{self.prefix}batch:active"

    def batch_job(self, job_id: str) -> str:
        return f"{self.prefix}batch:{job_id}"

    def batch_out(self, job_id: str) -> str:
        return f"{self.prefix}batch:{job_id}:out"

    def batch_lines(self, job_id: str) -> str:
        return f"{self.prefix}batch:{job_id}:lines"

    def batch_staging(self, job_id: str) -> str:
        return f"{self.prefix}batch:{job_id}:staging"

    def batch_written(self, job_id: str) -> str:
        return f"{self.prefix}batch:{job_id}:written"

    def batch_entry(self, entry_id: str) -> str:
        return f"{self.prefix}batch:entry:{entry_id}"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}file:{file_id}"

    @property
    def files(self) -> str:
        return f"{self.prefix}files"
