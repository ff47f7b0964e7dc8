"""The engine metrics of every live scheduler, for the gateway's /metrics.

Each scheduler writes its Prometheus text to `tf:metrics:{scheduler_id}` at every heartbeat,
with the heartbeat's TTL (service/telemetry.py); the schedulers are found in the registry
(protocol/registry.py). Here the texts are read and merged into
one exposition: samples of one metric family from all schedulers under one HELP/TYPE header
(Prometheus refuses a family declared twice), told apart by their `scheduler` label.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from protocol import registry
from protocol.keys import Keys
from shared.logging import get_logger

log = get_logger("tokenfleet.gateway.fleet_metrics")


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def merge_expositions(texts: list[bytes]) -> bytes:
    """One Prometheus text of every family in `texts`; a text that does not parse is skipped."""
    families: dict[str, Metric] = {}
    for text in texts:
        try:
            parsed = list(text_string_to_metric_families(text.decode()))
        except ValueError as exc:  # (the parser raises ValueError on a malformed line)
            log.warning("scheduler_metrics_unreadable", error=str(exc))
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                        family.unit)
            if merged.type == family.type:
                merged.samples.extend(family.samples)
    if not families:
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


async def read_fleet_metrics(client: aioredis.Redis, keys: Keys) -> bytes:
    """The merged metrics of every live scheduler (the registry's) whose key has not expired.
    One GET each in a pipeline: on a cluster the keys lie in different slots."""
    names = (await registry.live_members_async(client, keys, [registry.SCHEDULERS]))[registry.SCHEDULERS]
    if not names:
        return b""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(keys.scheduler_metrics(name))
    texts = await pipe.execute(raise_on_error=False)
    return merge_expositions([text for text in texts if isinstance(text, bytes) and text])
