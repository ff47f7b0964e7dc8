"""The engine's flags, in one table: `ENGINE_FLAGS`. From it

- `add_engine_flags` declares them on `scheduler`, `generate`, `up` and `autoscale`;
- `engine_config` builds the EngineConfig of a command's flags (the device's defaults applied
  by EngineConfig.for_device, shared/config.py, for the limits left out);
- `engine_argv` turns the flags a user gave `up` or `autoscale` back into the command line of
  each scheduler they start (`scheduler_command`), so that a flag added to the table reaches
  every scheduler with no other change.

The launchers set a few flags of each scheduler themselves (`LAUNCHER_SETS`: the model folder
they resolved once, the sizes of the group they place, the Ray they start or join, the
placement group they reserved); `engine_argv` leaves those out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shared.config import (
    DEFAULT_ITL_SLOWDOWN,
    DEVICE_DEFAULTS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    uses_ray,
)
from shared.errors import InvalidRequestError
from shared.pooling_params import RUNNERS
from shared.speculative import SpeculativeConfig, SpeculativeConfigError, parse_speculative_config
from tokenfleet.flags import flag

EXECUTORS = ("auto", "inprocess", "ray")


def on_off(text: str) -> bool:
    """--async-scheduling on|off (also true/false, as engine_argv passes a bool on)."""
    words = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return words[text.lower()]


def auto_on_off(text: str) -> bool | None:
    """--calculate-kv-scales auto|on|off: None, True or False (also true/false, as engine_argv
    passes a bool on)."""
    if text.lower() == "auto":
        return None
    try:
        return on_off(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}") from None


def itl_target(text: str) -> float | None:
    """--itl-target-ms auto|off|MS: None (auto), 0.0 (off) or a positive number of ms."""
    if text.lower() in ("auto", "none"):
        return None
    if text.lower() == "off":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or milliseconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected auto, off or milliseconds >= 0, got {text!r}")
    return value


def slowdown(text: str) -> float:
    """--itl-slowdown: a factor >= 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return value


def lora_module(text: str) -> str:
    """One of --lora-modules NAME=PATH ...: an adapter's name and its PEFT folder."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter name and its folder), got {text!r}")
    return f"{name.strip()}={path.strip()}"


def lora_modules(values: list[str] | str | None) -> dict[str, str]:
    """--lora-modules' values as EngineConfig.lora_modules (TOKENFLEET_LORA_MODULES: comma-separated)."""
    if isinstance(values, str):
        values = [lora_module(v) for v in values.replace(",", " ").split()]
    return dict(value.split("=", 1) for value in values or [])


def byte_count(text: str) -> int:
    """--max-weight-bytes-per-rank 24e9 (or 24000000000): a positive number of bytes."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 24e9, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {text!r}")
    return int(value)


def gib_size(text: str) -> float:
    """--kv-offloading-size 64 (GiB): a number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB such as 64, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of GiB >= 0, got {text!r}")
    return value


def speculative_config(text: str) -> SpeculativeConfig | None:
    """--speculative-config '{"method": "ngram", ...}' (vLLM's JSON); "off" or "": none."""
    if text.strip().lower() in ("", "off", "none"):
        return None
    try:
        return parse_speculative_config(text)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_CUDA, _CPU = DEVICE_DEFAULTS["cuda"], DEVICE_DEFAULTS["cpu"]


@dataclass(frozen=True)
class EngineFlag:
    name: str  # --name (and TOKENFLEET_NAME)
    help: str
    type: Callable = str
    default: object = None  # None for the limits EngineConfig.for_device fills by device
    field: str | None = ""  # the EngineConfig field it sets ("": its name with _); None: none
    choices: tuple[str, ...] | None = None
    switch: bool = False  # a store_true flag that turns its field off (--no-prefix-caching)
    turns_on: bool = False  # with switch: the flag turns its field on instead
    nargs: str | None = None  # "+": the flag takes several values (a list)
    convert: Callable | None = None  # the parsed value -> the EngineConfig field's value

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def config_field(self) -> str | None:
        return self.dest if self.field == "" else self.field


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("model", "Hugging Face model folder (default: SmolLM2-135M-Instruct, fetched once)"),
    EngineFlag("runner", "generate (text) or pooling (embeddings, /v1/embeddings: prefill only, one "
                         "vector per input; docs/embeddings.md)", default="generate", choices=RUNNERS),
    EngineFlag("tp", "tensor-parallel size (ranks per pipeline stage)", int, 1),
    EngineFlag("pp", "pipeline-parallel size: the layers split into this many stages of --tp ranks "
                     "(Ray groups)", int, 1),
    EngineFlag("executor", "auto (the scheduler's own process at TP=1, a Ray group above), inprocess or ray",
               default="auto", field=None, choices=EXECUTORS),
    EngineFlag("device", "cpu, cuda or cuda:N (default: cuda when present)"),
    EngineFlag("dtype", "float32, bfloat16 or float16 (default: bfloat16 on cuda, float32 on cpu)"),
    EngineFlag("max-model-len", "cap on prompt + output tokens (default: the model's context window)", int),
    EngineFlag("num-kv-blocks", "KV cache blocks (default: from memory)", int),
    EngineFlag("block-size", "tokens per KV block", int, 16),
    EngineFlag("quantization", "quantize linear weights at load: fp8 (Hopper's FP8 GEMMs) or int8 "
                               "(weight-only); default: as the checkpoint stores them",
               choices=QUANTIZATIONS),
    EngineFlag("max-weight-bytes-per-rank", "refuse to load when one rank's share of the weights needs "
                                            "more bytes than this (24e9 on 24 GB cards), before allocating",
               byte_count),
    EngineFlag("kv-cache-dtype", "K/V cache storage: auto (the serving dtype) or fp8 (e4m3, twice the blocks "
                                 "of bf16)", default="auto", choices=KV_CACHE_DTYPES),
    EngineFlag("calculate-kv-scales", "an fp8 KV cache's per-layer K/V scales: auto (the checkpoint's, else "
                                      "measured in the first step), on (measured even where the checkpoint "
                                      "has scales) or off (the checkpoint's, else 1.0)", auto_on_off),
    EngineFlag("max-num-seqs", "cap on running sequences (default: on CUDA sized to the card and the "
                               f"model, up to 1024; {_CPU.max_num_seqs} on CPU)", int),
    EngineFlag("max-num-batched-tokens", "tokens per step, chunked prefill (default: "
                                         f"{_CUDA.max_num_batched_tokens} on CUDA, "
                                         f"{_CPU.max_num_batched_tokens} on CPU)", int),
    EngineFlag("cuda-graph-max-batch-size", "largest decode batch replayed from a CUDA graph "
                                            "(default: --max-num-seqs, at most 512/256/128 by card)", int),
    EngineFlag("cuda-graph-max-tokens", "mixed steps (prefill chunks beside decodes) of up to this many "
                                        "tokens replay a CUDA graph (0: every mixed step eagerly)", int,
               EngineConfig.cuda_graph_max_tokens),
    EngineFlag("num-threads", "torch threads per rank on CPU", int),
    EngineFlag("ray-address", "join this Ray cluster (default: start a local Ray when needed)"),
    EngineFlag("placement-strategy", "Ray placement of a group's ranks: STRICT_PACK, PACK or SPREAD",
               default=EngineConfig.placement_strategy),
    EngineFlag("num-cpus-per-rank", "Ray CPUs per rank on CPU hosts", float, EngineConfig.num_cpus_per_rank),
    EngineFlag("placement-group", "use this named Ray placement group (reserved by the autoscaler) for the "
                                  "worker group instead of reserving one", field="placement_group_name"),
    EngineFlag("async-scheduling", "plan step n+1 while the device runs step n: on or off (default: on "
                                   "on CUDA, off on CPU, where a step runs as it is submitted)",
               on_off),
    EngineFlag("itl-target-ms", "while interactive (or more important) requests run or wait, less important "
                                "prefill (batch items) fills a step only up to this many ms: auto (the step "
                                "takes at most --itl-slowdown times what it would without it, from the "
                                "step times the engine measures), off, or a number", itl_target),
    EngineFlag("itl-slowdown", "with --itl-target-ms auto: how much longer a step may get beside less "
                               "important prefill (>= 1)", slowdown, DEFAULT_ITL_SLOWDOWN),
    EngineFlag("speculative-config", "speculative decoding, as vLLM spells it: a JSON object such as "
                                     '\'{"method": "ngram", "num_speculative_tokens": 4, '
                                     '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' '
                                     "(docs/speculative-decoding.md); default: off", speculative_config),
    EngineFlag("no-prefix-caching", "recompute every prompt instead of reusing the KV blocks of a prefix "
                                    "seen before", default=False, field="enable_prefix_caching", switch=True),
    EngineFlag("kv-offloading-size", "GiB of host memory per replica (pinned on CUDA, split across its "
                                     "ranks) that keeps copies of full KV blocks under the prefix cache, "
                                     "loaded back instead of recomputed (docs/kv-offloading.md); 0: off",
               gib_size, 0.0),
    EngineFlag("enable-lora", "serve LoRA adapters (PEFT folders) on the base model; off, the base path is "
                              "unchanged", default=False, switch=True, turns_on=True),
    EngineFlag("lora-modules", "adapters served from the start, as NAME=PATH (PEFT folders); a request names "
                               "one as its model", lora_module, nargs="+", convert=lora_modules),
    EngineFlag("max-loras", "adapters that share a step (device slots)", int, EngineConfig.max_loras),
    EngineFlag("max-lora-rank", "the largest adapter rank served", int, EngineConfig.max_lora_rank),
    EngineFlag("max-cpu-loras", "adapters kept read in host memory (default: --max-loras)", int),
    EngineFlag("grammar-jump-forward", "structured outputs: append the text a grammar forces (keys, "
                                       "closing braces) without sampling it; may spell it with other "
                                       "tokens than plain masked decoding", default=False, switch=True,
               turns_on=True),
)

# What `up` and `autoscale` set on each scheduler themselves (see scheduler_command).
LAUNCHER_SETS = frozenset({"model", "tp", "pp", "executor", "ray-address", "placement-group"})


def add_engine_flags(parser: argparse.ArgumentParser, *, exclude: Iterable[str] = (),
                     helps: dict[str, str] | None = None) -> None:
    """Declare every engine flag but `exclude` on `parser`; `helps` words some for this command."""
    excluded = set(exclude)
    for spec in ENGINE_FLAGS:
        if spec.name in excluded:
            continue
        text = (helps or {}).get(spec.name, spec.help)
        if spec.switch:
            flag(parser, spec.name, action="store_true", help=text)
        else:
            extra = {"choices": spec.choices} if spec.choices else {}
            if spec.nargs:
                extra["nargs"] = spec.nargs
            flag(parser, spec.name, type=spec.type, default=spec.default, help=text, **extra)


def check_executor(executor: str) -> None:
    if executor not in EXECUTORS:
        raise InvalidRequestError(f"--executor must be auto, inprocess or ray, got {executor!r}",
                                  param="executor")


def resolve_model(path: str | None) -> str:
    """The model folder of --model; without one, the default model's (fetched the first time)."""
    if path:
        return path
    from workers.default_model import fetch_default_model

    return str(fetch_default_model())


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a command's engine flags; limits left out take the device's defaults."""
    from workers.card_sizing import config_for_device
    from workers.device import resolve_device

    check_executor(args.executor)
    fields = {}
    for spec in ENGINE_FLAGS:
        if spec.config_field is not None:
            value = getattr(args, spec.dest, spec.default)  # (up and autoscale lack placement-group)
            fields[spec.config_field] = (value if spec.turns_on else not value) if spec.switch else value
            if spec.convert is not None:
                fields[spec.config_field] = spec.convert(value)
    fields["model"] = resolve_model(args.model)
    fields["use_ray"] = uses_ray(args.executor, args.tp, args.pp)
    return config_for_device(resolve_device(args.device), **fields)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags in `args` that differ from their defaults (given on the command line or
    by TOKENFLEET_* variables), as scheduler flags; LAUNCHER_SETS left out."""
    argv: list[str] = []
    for spec in ENGINE_FLAGS:
        if spec.name in LAUNCHER_SETS:
            continue
        value = getattr(args, spec.dest)
        if value == spec.default:
            continue
        if spec.switch:
            argv.append(f"--{spec.name}")
        elif isinstance(value, list):
            argv += [f"--{spec.name}", *map(str, value)]
        else:
            argv += [f"--{spec.name}", str(value)]
    return argv


def scheduler_command(*, redis_url: str, model: str, model_name: str, scheduler_id: str, tp: int = 1,
                      pp: int = 1, executor: str = "auto", ray_address: str | None = None,
                      placement_group: str | None = None, engine_args: Iterable[str] = (),
                      extra: Iterable[str] = ()) -> list[str]:
    """One replica's `tokenfleet scheduler` command line, as `up` and `autoscale` start it: what
    the launcher sets (LAUNCHER_SETS; --ray-address only for a Ray group), then `engine_args`
    (engine_argv of the launcher's own flags), then `extra` (other scheduler flags)."""
    ray_args = ["--ray-address", ray_address] if ray_address and uses_ray(executor, tp, pp) else []
    return [sys.executable, "-m", "tokenfleet.cli", "scheduler", "--redis-url", redis_url, *ray_args,
            *(["--placement-group", placement_group] if placement_group else []),
            "--model", model, "--model-name", model_name, "--scheduler-id", scheduler_id,
            "--tp", str(tp), "--pp", str(pp), "--executor", executor, *engine_args, *extra]
