"""The fleet's Redis work on 1 shard and on 3: the successor of the Redis pattern benchmark
(docs/scaling.md, section 5). Run by hand (not a test):

    .venv/bin/python scripts/bench_redis_shards.py [--shards 1,3] [--drivers 4] [--seconds 10]
    .venv/bin/python scripts/bench_redis_shards.py --smoke      # a few seconds, to see it works

Each configuration is a fresh local Redis Cluster (tokenfleet/redis_cluster.py: N primaries,
N replicas, Debian's redis-server 7) driven by `--drivers` processes, each a scheduler's Redis
side at saturation: a batch of `--batch` requests whose every step is the real result write
(service/result_store.py: one write_results.lua call per partition, SPUBLISH of each token
event, WAIT for the replicas) with one token per request, claims of new requests as old ones
end. No model runs: the drivers only make Redis work, as fast as Redis takes it. Printed: the
tokens (request steps) per second over all drivers, and each node's CPU (user + sys seconds
from INFO, over the measured window) as a share of one core. A 2-core machine limits the
absolute figure; the ratio and the CPU spread across shards are what matter.
"""

from __future__ import annotations

import argparse

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from testkit.redis_shard_load import run
from testkit.runs import print_command


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", default="1,3", help="comma-separated shard counts")
    parser.add_argument("--drivers", type=int, default=4, help="scheduler-like driver processes")
    parser.add_argument("--batch", type=int, default=64, help="requests per driver step")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--smoke", action="store_true", help="a short run, to see that it works")
    args = parser.parse_args()
    if args.smoke:
        args.drivers, args.batch, args.seconds = 2, 16, 2.0
    print_command()
    rows = [run(int(n), args.drivers, args.batch, args.seconds) for n in args.shards.split(",")]
    base = rows[0]["tokens_per_s"]
    print(f"\n{args.drivers} drivers x batch {args.batch}, {args.seconds:.0f} s each\n")
    print("| shards | tokens/s | vs first | CPU of each primary (cores) | CPU of each replica (cores) |")
    print("| ---: | ---: | ---: | --- | --- |")
    for row in rows:
        primaries = " / ".join(f"{c:.2f}" for c in row["primary_cpu"])
        replicas = " / ".join(f"{c:.2f}" for c in row["replica_cpu"])
        print(f"| {row['shards']} | {row['tokens_per_s']:,.0f} | {row['tokens_per_s'] / base:.2f}x | "
              f"{primaries} | {replicas} |")


if __name__ == "__main__":
    main()
