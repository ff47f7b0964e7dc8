"""bench_redis_shards.py's load: driver processes that each do a scheduler's Redis work at
saturation (the real result writes of service/result_store.py, a token per request per step,
claims of new requests as old ones end) against a fresh local Redis Cluster, no model; the
tokens per second over all drivers and each node's CPU share over the measured window."""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from pathlib import Path

from protocol.keys import keys_for
from protocol.messages import TokenEvent, pack_list_chunk
from protocol.result_record import step_appends, step_fields
from service.result_store import ResultStore, ResultUpdate
from shared.redis_client import connect, connect_node
from tokenfleet.redis_cluster import RedisCluster

REQUEST_LIFE_STEPS = 64  # a request ends (and a new one is claimed) after this many tokens


def drive(url: str, driver: int, batch: int, seconds: float, counts) -> None:
    """One scheduler's Redis work at saturation: `batch` requests, one token each per step."""
    client = connect(url, socket_timeout=30)
    keys = keys_for(url)
    store = ResultStore(client, keys, f"driver-{driver}", ttl_s=300)
    serial = 0

    def new_request() -> list:
        nonlocal serial
        serial += 1
        return [f"d{driver}-{serial:08d}", 0]  # req id, seq

    live = [new_request() for _ in range(batch)]
    store.claim_many([r for r, _ in live], [keys.cancelled(r) for r, _ in live])
    deadline = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < deadline:
        updates = []
        for request in live:
            request[1] += 1
            req_id, seq = request
            event = TokenEvent(req_id, seq, [1000 + seq], " tok", None).encode()
            appends = step_appends(pack_list_chunk([[seq, 4 * seq]]),
                                   token_ids_chunk=pack_list_chunk([1000 + seq]), text=" tok")
            stream = keys.stream_for(req_id, "bench", "interactive")  # (its entry's: its partition's)
            updates.append(ResultUpdate(req_id, stream, step_fields(seq), event=event, appends=appends))
        store.write(updates)
        steps += len(updates)
        ended = [i for i, (_, seq) in enumerate(live) if seq >= REQUEST_LIFE_STEPS]
        if ended:
            for i in ended:
                live[i] = new_request()
            fresh = [live[i][0] for i in ended]
            store.claim_many(fresh, [keys.cancelled(r) for r in fresh])
    counts[driver] = steps


def cpu_seconds(cluster: RedisCluster) -> dict[int, float]:
    out = {}
    for port in cluster.ports:
        info = connect_node(cluster.host, port, socket_timeout=5).info("cpu")
        out[port] = float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
    return out


def run(num_shards: int, drivers: int, batch: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        cluster = RedisCluster(Path(folder), num_shards)
        cluster.start()
        try:
            primaries = set(cluster.primaries())
            counts = multiprocessing.Manager().dict()
            procs = [multiprocessing.Process(target=drive, args=(cluster.url, d, batch, seconds, counts))
                     for d in range(drivers)]
            before, started = cpu_seconds(cluster), time.monotonic()
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            elapsed = time.monotonic() - started
            after = cpu_seconds(cluster)
        finally:
            cluster.stop()
    busy = {port: (after[port] - before[port]) / elapsed for port in cluster.ports}
    return {"shards": num_shards, "tokens_per_s": sum(counts.values()) / elapsed,
            "primary_cpu": sorted((busy[p] for p in primaries), reverse=True),
            "replica_cpu": sorted((busy[p] for p in cluster.ports if p not in primaries), reverse=True)}
