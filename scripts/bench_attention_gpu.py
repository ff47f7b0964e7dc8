"""Decode attention at the card's pace: the paged-attention kernel the engine runs, on one layer of
Llama-3-8B-shaped decode steps (32 query heads, 8 KV heads, head dim 128, bf16, 16-token pages)
at 1k, 4k and 16k tokens of context, as GB/s of the bytes it must move (K/V of every row's
context, block tables, q and out) and as a fraction of the copy bandwidth measured in the same
run; each decode kernel the engine can take (paged: the default; split: the split-context
candidate, TOKENFLEET_DECODE_ATTENTION=split); and a mixed step's decode and prefill rows as
the engine launches them (two launches) against one launch. Run by hand on a GPU (~1-2 min):

    python3 scripts/bench_attention_gpu.py
    python3 scripts/bench_attention_gpu.py --contexts 4096,16384 --batches 32,64,128 \
        --kernels 'paged;split;split:BLOCK_N=128,NUM_STAGES=2;split:NUM_WARPS=8'   # a sweep
    python3 scripts/bench_attention_gpu.py --device cpu   # a tiny form in Triton's interpreter

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here): a check that
the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys

import _repo  # noqa: F401 - first: it puts the repository on sys.path


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the interpreter's tiny form")
    parser.add_argument("--contexts", type=_ints, help="tokens of context per row (default 1024,4096,16384; "
                                                       "CPU: 64,256)")
    parser.add_argument("--batches", type=_ints, help="decode rows per step (default 64,256; CPU: 2)")
    parser.add_argument("--kernels", type=lambda t: t.split(";"), default=["paged", "split"],
                        help="decode kernels to time, ';' between them: paged, split, or split with its "
                             "settings, e.g. 'paged;split;split:BLOCK_N=32,NUM_STAGES=4'")
    parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16", help="K/V cache storage")
    parser.add_argument("--mixed", type=_ints, help="mixed step: decodes, their context, prefill chunk "
                                                    "tokens... (default 256,1024,1024,1024; CPU: 2,64,32)")
    parser.add_argument("--max-cache-gib", type=float, default=24.0, help="skip cases whose K/V needs more")
    parser.add_argument("--copy-gib", type=float, default=1.0, help="the copy that measures bandwidth")
    args = parser.parse_args(argv)
    cpu = args.device.startswith("cpu")
    args.contexts = args.contexts or ([64, 256] if cpu else [1024, 4096, 16384])
    args.batches = args.batches or ([2] if cpu else [64, 256])
    args.mixed = args.mixed or ([2, 64, 32] if cpu else [256, 1024, 1024, 1024])
    if len(args.mixed) < 3:
        parser.error("--mixed takes decodes, their context and at least one prefill chunk's tokens")
    if cpu:
        args.copy_gib = min(args.copy_gib, 1 / 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = args.device.startswith("cpu")
    if cpu:  # read when Triton is imported: before anything of ours imports it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from testkit.attention_bench import HEADER, decode_rows, kernel_error, measure_copy, mixed_rows
    from testkit.runs import print_command
    from workers.layers import triton_attention

    if triton_attention.triton is None:
        print("Triton is not installed: this bench times the Triton kernels (on a CPU, in Triton's "
              "interpreter)", file=sys.stderr)
        return 2
    if not cpu and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available (use --device cpu for the interpreter's "
              "tiny form)", file=sys.stderr)
        return 2
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        print("--device cpu needs Triton's interpreter: TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    for kernel in args.kernels:
        error = kernel_error(kernel)
        if error:
            print(f"--kernels {kernel}: {error}", file=sys.stderr)
            return 2
    print_command()
    device = torch.device(args.device)
    dtype = torch.float32 if cpu else torch.bfloat16  # (the interpreter's bf16 products are wrong)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else dtype
    copy_rate = measure_copy(device, int(args.copy_gib * 2**30))
    name = torch.cuda.get_device_name(device) if not cpu else "CPU (Triton's interpreter: not a measurement)"
    print(f"{name}: copy {copy_rate / 1e9:,.0f} GB/s (device-to-device copy of {args.copy_gib:g} GiB, "
          f"bytes read + written); q {str(dtype).removeprefix('torch.')}, "
          f"K/V {str(kv_dtype).removeprefix('torch.')}, one layer of 32 q / 8 KV heads x 128\n", flush=True)
    print(HEADER, flush=True)
    for row in decode_rows(args.contexts, args.batches, args.kernels, device, dtype, kv_dtype,
                           int(args.max_cache_gib * 2**30)):
        print(row.line(copy_rate), flush=True)
    num_decodes, context, *prefills = args.mixed
    for row in mixed_rows(num_decodes, context, prefills, args.kernels, device, dtype, kv_dtype):
        print(row.line(copy_rate), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
