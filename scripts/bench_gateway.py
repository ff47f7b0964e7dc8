"""One gateway process holding many concurrent SSE streams: its memory per stream, and the
inter-token latency that the gateway + pub/sub path adds over the scheduler's own step time.
Run by hand (not a test); prints one table, the baseline measured in the same run:

    .venv/bin/python scripts/bench_gateway.py [--streams 1000] [--max-tokens 64] [--port P]

Processes: a real Redis (tokenfleet/redis_server.py), one `tokenfleet scheduler` and one
`tokenfleet gateway` (each its own process), a raw-socket listener process that
PSUBSCRIBEs tf:ev:* and only timestamps the bytes Redis sends it, and this process, whose
asyncio + aiohttp clients open --streams streaming /v1/chat/completions at once (spread
over --ramp-s), greedy, EOS ignored, --max-tokens each. The model is a tiny random llama
(2 layers, hidden 64) with SmolLM2's tokenizer and chat template, so the gateway does its
real work (chat template, tokenizer, detokenized text) while the model costs little.

Measured in one run:
- errors: a status other than 200, a chunk that is not a well-formed chat.completion.chunk,
  no `data: [DONE]`, a finish_reason other than "length" or usage.completion_tokens other
  than --max-tokens, or any client exception;
- gateway memory: RSS after a warm-up, before the streams open, and its peak while they
  run (sampled every 10 ms, and the kernel's VmHWM after resetting it); per stream =
  (peak - before) / streams;
- the baseline: the scheduler's step interval as seen directly on Redis pub/sub (gaps
  between consecutive events of one request at the listener);
- client inter-token latency: gaps between consecutive content chunks of one stream (and
  its median minus the step interval's median: what the path adds to the cadence itself);
- added inter-token latency (the goal's figure): for each content chunk after a stream's
  first, its gap to the stream's previous chunk at the SSE client minus the gap between the
  same two events at the listener: what the gateway + pub/sub path adds to the interval
  between one token and the next, over the scheduler's own step time. Chunks are matched to
  events by request id (the chunk id minus "chatcmpl-") and by how much text has arrived (a
  chunk carries the text of its event); both clocks are this machine's CLOCK_MONOTONIC;
- delivery lag (reported, no goal): each chunk's arrival at the client minus its event's at
  the listener. It grows with --streams: one gateway process (and this one client process)
  turn a step's events into chunks one after another, so a stream late in that order is
  late by the same amount at every step, which shifts its tokens without stretching the
  intervals between them;
- the gateway's CPU time (user + system) per streamed token, request setup included.
Every token of the run counts, the ramp-up included. --profile-gateway FILE runs the
gateway under cProfile (slower; for finding where its time goes).
Goal: no errors, under 100 KiB per stream, under 2 ms added at the median.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import tempfile
from pathlib import Path

import _repo  # noqa: F401 - first: it puts the repository on sys.path

from shared.logging import configure_logging
from testkit.gateway_streams import GatewayRun, run
from testkit.processes import Children
from testkit.runs import percentile, print_command

GOAL_KIB_PER_STREAM = 100.0
GOAL_ADDED_MS = 2.0


# -- the table ------------------------------------------------------------------------------------

def ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 1e3:.2f}"


def spread(values: list[float]) -> str:
    return " / ".join(ms(percentile(values, q)) for q in (50, 90, 99))


def print_table(args: argparse.Namespace, r: GatewayRun) -> None:
    errors, before, peak, wall_s = r.errors, r.rss_before, r.rss_peak, r.wall_s
    user_s, sys_s = r.user_s, r.sys_s
    client_gaps, step_gaps, added_itl, added = r.client_gaps, r.step_gaps, r.added_itl, r.added
    num_tokens = args.streams * args.max_tokens
    per_token_us = 1e6 / max(num_tokens, 1)
    kib_per_stream = (peak - before) / args.streams / 1024
    added_median = percentile(added_itl, 50)
    itl_diff_ms = (percentile(client_gaps, 50) - percentile(step_gaps, 50)) * 1e3

    print(f"\n| one gateway, {args.streams} concurrent SSE streams x {args.max_tokens} tokens "
          f"(tiny model, float32) | value | goal |")
    print("| --- | --- | --- |")
    print(f"| streams: errors / held open at once | {len(errors)} / {r.max_open} | 0 errors |")
    print(f"| gateway RSS before streams / peak, MiB | {before / 2**20:.1f} / {peak / 2**20:.1f} | |")
    print(f"| gateway memory per stream, KiB | {kib_per_stream:.1f} | < {GOAL_KIB_PER_STREAM:.0f} |")
    print(f"| scheduler step interval on pub/sub (baseline), median / p90 / p99 ms | {spread(step_gaps)} | |")
    print(f"| inter-token latency at the SSE client, median / p90 / p99 ms | {spread(client_gaps)} | |")
    print(f"| **inter-token latency added by gateway + pub/sub** (per token: client gap - listener gap), "
          f"median / p90 / p99 ms | {spread(added_itl)} | < {GOAL_ADDED_MS:.0f} at the median |")
    print(f"| client ITL median - step interval median, ms | {itl_diff_ms:.2f} | |")
    print(f"| delivery lag (client arrival - listener arrival), median / p90 / p99 ms | {spread(added)} | |")
    print(f"| gateway CPU per streamed token, user + system (request setup included), us "
          f"| {user_s * per_token_us:.0f} + {sys_s * per_token_us:.0f} | |")
    print(f"| wall time, s / output tok/s | {wall_s:.1f} / {num_tokens / wall_s:.0f} | |")
    goals = [not errors, kib_per_stream < GOAL_KIB_PER_STREAM,
             not math.isnan(added_median) and added_median * 1e3 < GOAL_ADDED_MS]
    print(f"\nchunks matched to listener events: {r.matched} ({r.unmatched} unmatched); "
          f"peak RSS {'sampled every 10 ms and VmHWM' if r.hwm_reset else 'sampled every 10 ms'}")
    print(f"goals met: {'yes' if all(goals) else 'no'} (errors {'ok' if goals[0] else 'FAIL'}, "
          f"memory {'ok' if goals[1] else 'FAIL'}, added latency {'ok' if goals[2] else 'FAIL'})")
    if r.max_open < args.streams:
        print(f"warning: only {r.max_open} of {args.streams} streams were open at once "
              "(raise --max-tokens or lower --ramp-s)")
    for s in errors[:5]:
        print(f"  stream {s.index}: {s.error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1000, help="concurrent SSE streams")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (EOS ignored)")
    parser.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    parser.add_argument("--ramp-s", type=float, default=0.0,
                        help="spread the stream starts over this long (default: all at once)")
    parser.add_argument("--warmup-streams", type=int, default=8)
    parser.add_argument("--profile-gateway", metavar="FILE",
                        help="run the gateway under cProfile and write its stats here (slows it down)")
    parser.add_argument("--scheduler-threads", type=int, default=1,
                        help="torch threads of the scheduler (0: torch's default)")
    args = parser.parse_args()
    if args.streams < 1 or args.max_tokens < 1 or args.max_tokens > 400:
        parser.error("--streams must be >= 1 and --max-tokens in [1, 400] (the tiny model's window is 512)")
    print_command()
    configure_logging("WARNING")

    def terminate(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    with tempfile.TemporaryDirectory(prefix="bench_gateway-") as tmp:
        children = Children(Path(tmp))
        try:
            print_table(args, run(args, Path(tmp), children))
        except KeyboardInterrupt:
            print("interrupted; every process stopped", file=sys.stderr)
            sys.exit(130)


if __name__ == "__main__":
    main()
