"""Every Redis key tokenfleet uses, in one place. The prefix (default "tf:") is configurable.

| key                                   | type          | written by              | read by               |
| ------------------------------------- | ------------- | ----------------------- | --------------------- |
| {p}req:{model}:{interactive|batch}    | stream        | gateway, batch ingester | schedulers (group)    |
| {p}ev:{req_id}                        | pub/sub       | scheduler               | gateway               |
| {p}res:{req_id}                       | hash with TTL | scheduler               | gateway, a successor  |
| {p}cancel                             | pub/sub       | gateway                 | schedulers            |
| {p}cancelled:{req_id}                 | string + TTL  | gateway                 | schedulers            |
| {p}sched:{scheduler_id}               | hash with TTL | scheduler (heartbeat)   | gateway, metrics      |
| {p}dead                               | stream        | scheduler               | operators             |

Request ids are made by the server (never client text), so they are safe inside keys.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSUMER_GROUP = "schedulers"
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

    @property
    def dead(self) -> str:
        return f"{self.prefix}dead"
