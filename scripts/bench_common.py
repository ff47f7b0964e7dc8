"""What the benchmark scripts share, written once:

- workloads: ShareGPT-like lognormal lengths (the GPU benchmarks) or uniform ones (the CPU
  benchmarks), as prompt token ids and output lengths;
- the hardware, measured in the same run: matrix rate, copy and read bandwidth; and the floors
  (roofline) of a workload at those rates;
- checkpoints: Llama-3-8B's shape, random-weight models built on the device, a tiny llama with
  SmolLM2's tokenizer, a folder to write them to;
- engine runs: a warm-up, and a workload stepped with every request added at once;
- child processes: start, wait until ready, stop (no orphans, even when this process is
  killed), their CPU time; a redis-server with a chosen fsync policy;
- the queue seen from outside: request messages XADDed, waiting until they ended, a listener
  process that timestamps token events as Redis publishes them;
- percentiles, a timestamped log, SIGTERM as an exception.

The scripts import it as `bench_common` (it sits beside them, and a script's folder is on
sys.path when it runs); the fleet never imports it.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import json
import math
import multiprocessing
import os
import pickle
import random
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # a GPU host runs the scripts from a plain checkout

from protocol.keys import Keys  # noqa: E402
from protocol.messages import RequestMessage  # noqa: E402
from shared.net import free_port  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402

if TYPE_CHECKING:
    import torch

    from scheduler.engine import LLMEngine

KEYS = Keys()
T0 = time.perf_counter()


# -- the run -----------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {message}", flush=True)


def print_command() -> None:
    """The exact command line, first thing: a table without it cannot be reproduced."""
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    print("$", shlex.join([python, *sys.argv]), flush=True)


class Interrupted(BaseException):
    """SIGTERM (e.g. from `timeout`): stop measuring, print the table so far."""


def stop_on_sigterm() -> None:
    def handler(signum, frame):
        raise Interrupted()

    signal.signal(signal.SIGTERM, handler)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# -- workloads ---------------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids of each request's prompt
    max_tokens: list[int]  # output tokens of each request (EOS ignored: exactly this many)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.max_tokens[:n])

    def batches(self, size: int) -> list[range]:
        return [range(i, min(i + size, len(self.prompts))) for i in range(0, len(self.prompts), size)]


def lognormal_length(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    # A lognormal of mean m has mu = ln m - sigma^2 / 2.
    return min(high, max(low, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))


def sharegpt_workload(num_requests: int, vocab_size: int, *, prompt_max: int = 1024, output_max: int = 512,
                      seed: int = 0) -> Workload:
    """ShareGPT-like lengths: per request a prompt of random ids (lognormal length, mean 200,
    sigma 0.9, 8..prompt_max), then its output length (mean 180, sigma 0.8, 8..output_max)."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        num_prompt = lognormal_length(rng, 200, 0.9, 8, prompt_max)
        prompts.append([rng.randrange(vocab_size) for _ in range(num_prompt)])
        max_tokens.append(lognormal_length(rng, 180, 0.8, 8, output_max))
    return Workload(prompts, max_tokens)


def uniform_workload(num_requests: int, vocab_size: int, *, prompt_lens: tuple[int, int],
                     output_lens: tuple[int, int], first_id: int = 3, seed: int = 0) -> Workload:
    """Per request: a prompt of uniform length of ids from [first_id, vocab) (clear of SmolLM2's
    special ids 0-2), then a uniform output length; bounds inclusive."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        num_prompt = rng.randint(*prompt_lens)
        prompts.append([rng.randrange(first_id, vocab_size) for _ in range(num_prompt)])
        max_tokens.append(rng.randint(*output_lens))
    return Workload(prompts, max_tokens)


# -- the hardware and the floors ---------------------------------------------------------------


def sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device: torch.device, min_seconds: float = 1.0, min_calls: int = 3) -> float:
    """After a warm-up call, repeat fn for at least min_seconds; synchronising rarely (batches
    of up to 64 calls), so a GPU stays busy while the host checks the clock."""
    fn()
    sync(device)
    calls, batch, start = 0, 1, time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        calls += batch
        sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and calls >= min_calls:
            return elapsed / calls
        batch = min(2 * batch, 64)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, min_seconds: float = 1.0) -> float:
    """FLOP/s of a size^3 matrix product on random data."""
    import torch

    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / seconds_per_call(lambda: a @ b, device, min_seconds)


def copy_bandwidth(device: torch.device, num_bytes: int, min_seconds: float = 1.0) -> float:
    """Bytes/s of a copy of num_bytes, counting bytes read and written."""
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * num_bytes / seconds_per_call(lambda: dst.copy_(src), device, min_seconds)


def read_bandwidth(device: torch.device, num_bytes: int, min_seconds: float = 1.0) -> float:
    """Bytes/s of reading num_bytes (a sum): one tensor far larger than the caches."""
    import torch

    x = torch.ones(num_bytes // 4, device=device)
    return num_bytes / seconds_per_call(x.sum, device, min_seconds)


@dataclass(frozen=True)
class ModelShape:
    """The sizes the floors need, named as in shared.model_config.ModelConfig."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        """From a ModelConfig, or from a dict of transformers config fields (LLAMA3_8B)."""
        if not isinstance(config, dict):
            return cls(config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                       config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings)
        heads = config["num_attention_heads"]
        return cls(config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], heads,
                   config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // heads,
                   config["vocab_size"], config.get("tie_word_embeddings", False))

    @property
    def layer_matrix_params(self) -> int:
        """One layer's matrices: qkv_proj, o_proj, gate, up and down."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
                + 3 * self.hidden_size * self.intermediate_size)

    @property
    def num_params(self) -> int:
        """Every parameter (no biases): embeddings, LM head unless tied, layers with their two norms,
        the final norm."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        per_layer = self.layer_matrix_params + 2 * self.hidden_size
        return embeddings + self.num_layers * per_layer + self.hidden_size

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def dense_flops(num_params: int, workload: Workload) -> float:
    """2 FLOPs per parameter per prompt and output token: the GPU target's definition (LM head
    for every token, attention left out)."""
    return 2.0 * num_params * (workload.num_prompt_tokens + workload.num_output_tokens)


def exact_flops(shape: ModelShape, workload: Workload) -> tuple[float, float]:
    """(linear, attention) FLOPs: every layer's weights for every token, the LM head only where
    a token is sampled (the last prompt position counts as the first output), and causal
    attention's QK^T and AV; embeddings are lookups and norms are negligible."""
    num_tokens = workload.num_prompt_tokens + workload.num_output_tokens
    linear = (2.0 * shape.num_layers * shape.layer_matrix_params * num_tokens
              + 2.0 * shape.vocab_size * shape.hidden_size * workload.num_output_tokens)
    # The token at position p attends to p + 1 keys: 2 FLOPs per (head, dim, key) for QK^T and as
    # many for AV. Summed over a sequence of n tokens: n (n + 1) / 2 keys.
    key_visits = sum((n := len(p) + m) * (n + 1) // 2
                     for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
    return linear, 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * key_visits


def cached_tokens_read(workload: Workload) -> int:
    """Output token j of a request reads the K/V of its prompt and of its j earlier outputs."""
    pairs = zip(workload.prompts, workload.max_tokens, strict=True)
    return sum(m * len(p) + m * (m - 1) // 2 for p, m in pairs)


def min_decode_steps(workload: Workload, max_num_seqs: int | None = None) -> int:
    """A sequence gains one token per step; at most max_num_seqs of them run in one step."""
    steps = max(workload.max_tokens)
    if max_num_seqs is not None:
        steps = max(steps, -(-workload.num_output_tokens // max_num_seqs))
    return steps


@dataclass
class Roofline:
    """Floors of a workload, in seconds; the roofline is the larger of compute and memory."""

    compute_s: float  # the FLOPs at the measured matrix rate
    weight_stream_s: float  # every weight read once per decode step
    kv_read_s: float  # every output token's read of its cached K/V
    num_steps: int

    @property
    def memory_s(self) -> float:
        return self.weight_stream_s + self.kv_read_s

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)


def roofline(flops: float, weight_bytes: int, kv_bytes_per_token: int, workload: Workload, *,
             flop_rate: float, bandwidth: float, max_num_seqs: int | None = None) -> Roofline:
    steps = min_decode_steps(workload, max_num_seqs)
    return Roofline(flops / flop_rate, steps * weight_bytes / bandwidth,
                    cached_tokens_read(workload) * kv_bytes_per_token / bandwidth, steps)


# -- checkpoints -------------------------------------------------------------------------------

# Tiny checkpoints with SmolLM2's tokenizer live in workers/checkpoints.py (the tests build them
# too); the scripts import them from here. Looked up on first use, so that importing this module
# does not import torch.
_FROM_CHECKPOINTS = ("SMOLLM2_VOCAB_SIZE", "TOKENIZER_FILES", "copy_tokenizer",
                     "tiny_llama_with_smollm2_tokenizer")


def __getattr__(name: str) -> Any:
    if name in _FROM_CHECKPOINTS:
        import workers.checkpoints

        return getattr(workers.checkpoints, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
INIT_STD = 0.02


def checkpoint_folder(num_bytes: int) -> Path:
    """A fresh folder in /dev/shm when it has room (loads at memory speed), else in the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * num_bytes:
        return Path(tempfile.mkdtemp(prefix="tokenfleet-bench-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="tokenfleet-bench-"))


def random_model(config: Any, device: torch.device, *, std: float = INIT_STD,
                 embedding_std: float | None = None, seed: int = 0) -> torch.nn.Module:
    """A transformers model of `config` with random bf16 weights, built on the device: norms 1,
    embeddings and LM head normal(0, embedding_std or std), every other matrix and bias normal(0, std)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # explicit, whatever from_config initialised
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            elif "embed_tokens" in name or name.startswith("lm_head"):
                param.normal_(0.0, embedding_std or std, generator=generator)
            else:
                param.normal_(0.0, std, generator=generator)
    return model.eval()


def random_llama(shape: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A Llama of `shape` (transformers LlamaConfig fields, e.g. LLAMA3_8B) with random bf16 weights."""
    from transformers import LlamaConfig

    return random_model(LlamaConfig(**shape, initializer_range=INIT_STD), device, seed=seed)


def module_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- engine runs ---------------------------------------------------------------------------------


def start_local_ray(env_vars: dict[str, str]) -> None:
    """A Ray for this run alone (never a cluster some `ray start` left recorded), its workers
    started with `env_vars` (NCCL settings must reach every rank before NCCL starts)."""
    import ray

    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 4), include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": env_vars})


def greedy(max_tokens: int) -> SamplingParams:
    """What every benchmark asks for: greedy, exactly max_tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


WARMUP_PROMPT_LENS = (8, 100, 600, 17)


def warmup_prompts(vocab_size: int, max_len: int | None = None) -> list[list[int]]:
    """A few prompts of different lengths (clipped to leave room for 16 tokens in max_len)."""
    rng = random.Random(2)
    lens = [n if max_len is None else min(n, max_len - 16) for n in WARMUP_PROMPT_LENS]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


def warm_up(engine: LLMEngine, vocab_size: int) -> None:
    """First-call costs (kernel compiles, cuBLAS plans, prefill attention) are not throughput."""
    engine.generate(warmup_prompts(vocab_size, engine.max_model_len), greedy(8))


@dataclass
class EngineRun:
    seconds: float
    num_requests: int
    num_output_tokens: int
    num_total_tokens: int  # output tokens + prompts of the requests that started
    num_steps: int
    num_graph_steps: int | None  # decode steps replayed from a CUDA graph (None: no graphs)
    execute_s: float  # in the workers' execute
    token_times: dict[str, list[float]]  # req_id -> perf_counter when each step giving it tokens returned
    start: float  # perf_counter when the first request was added
    partial_limit_s: float | None = None  # stopped at this time limit

    @property
    def output_rate(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_rate(self) -> float:
        return self.num_total_tokens / self.seconds

    @property
    def notes(self) -> str:
        replays = f" ({self.num_graph_steps} CUDA-graph decodes)" if self.num_graph_steps is not None else ""
        notes = (f"{self.num_requests} requests; {self.num_steps} steps{replays}; "
                 f"{self.execute_s / self.seconds:.0%} of the time in the workers' execute")
        if self.partial_limit_s is not None:
            notes += (f"; PARTIAL: stopped at the {self.partial_limit_s:.0f} s limit, "
                      f"{len(self.token_times)} requests started")
        return notes


def run_engine_workload(engine: LLMEngine, workload: Workload, seconds_limit: float,
                        device: torch.device) -> EngineRun:
    """Every request added at once, then stepped until done or until the time limit (then the rest
    is aborted and the run is partial). Counts steps, CUDA-graph replays and time in execute."""
    runner = getattr(engine.executor, "runner", None)
    counts = {"steps": 0, "graph_steps": 0, "execute_s": 0.0}
    executor = engine.executor
    submit, collect = executor.submit, executor.collect

    def timed_submit(batch):
        start = time.perf_counter()
        try:
            return submit(batch)
        finally:
            counts["execute_s"] += time.perf_counter() - start

    def timed_collect(handle):
        start = time.perf_counter()
        try:
            return collect(handle)
        finally:
            counts["steps"] += 1
            counts["execute_s"] += time.perf_counter() - start

    executor.submit, executor.collect = timed_submit, timed_collect
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is not None:
        graph_run = graphs.run

        def counted_run(works, hidden_in=None):
            counts["graph_steps"] += 1
            return graph_run(works, hidden_in)

        graphs.run = counted_run
    prompt_len: dict[str, int] = {}
    token_times: dict[str, list[float]] = {}
    sync(device)
    start = time.perf_counter()
    for prompt, max_tokens in zip(workload.prompts, workload.max_tokens, strict=True):
        prompt_len[engine.add_request(prompt, greedy(max_tokens))] = len(prompt)
    num_output, partial = 0, False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                num_output += len(out.new_token_ids)
                token_times.setdefault(out.req_id, []).append(now)
        if now - start > seconds_limit:
            partial = True
            break
    elapsed = time.perf_counter() - start
    del executor.submit, executor.collect  # the class's own again
    if graphs is not None:
        graphs.run = graph_run
    if partial:
        for req_id in prompt_len:
            engine.abort(req_id)
        while engine.has_unfinished_requests():
            engine.step()
    elif num_output != workload.num_output_tokens:
        raise RuntimeError(f"the engine made {num_output} tokens, not {workload.num_output_tokens}")
    num_total = num_output + sum(prompt_len[r] for r in token_times)
    return EngineRun(elapsed, len(workload.prompts), num_output, num_total, counts["steps"],
                     counts["graph_steps"] if graphs is not None else None, counts["execute_s"], token_times,
                     start, seconds_limit if partial else None)


# -- child processes ---------------------------------------------------------------------------

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1
_SIGTERM = int(signal.SIGTERM)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when this process dies, even by SIGKILL; its
    own session would otherwise outlive us (and hold the GPU)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, _SIGTERM)


class Children:
    """Child processes (Redis, schedulers, gateways), each in its own session with its log in
    log_dir; stopped in reverse order of start, each with its whole process group."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log_file = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
        env = {**os.environ, "TOKENFLEET_LOG_LEVEL": os.environ.get("TOKENFLEET_LOG_LEVEL", "WARNING")}
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self.procs.append((name, proc))
        return proc

    def pid(self, name: str) -> int:
        return next(proc.pid for n, proc in self.procs if n == name)

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, num_chars: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""

    def stop(self) -> None:
        # A second Ctrl-C (or SIGTERM) must not cut the cleanup short.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for _, proc in reversed(self.procs):
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
            for _, proc in reversed(self.procs):
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=5)
            self.procs = []
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def wait_ready(url: str, children: Children, timeout_s: float = 180.0) -> None:
    """Until the gateway at url answers /ready with 200 (Redis reachable, a scheduler serving)."""
    deadline = time.monotonic() + timeout_s
    while True:
        children.check()
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway was not ready within {timeout_s:.0f} s")
        time.sleep(0.2)


def start_redis(children: Children, data_dir: Path, *, appendfsync: str = "always") -> tuple[str, int]:
    """redis-server as tokenfleet/redis_server.py starts it (append-only file), with a chosen
    fsync policy; (url, port)."""
    from tokenfleet.redis_server import redis_server_binary, wait_for_redis

    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    children.spawn("redis-server", [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
                                    "--dir", str(data_dir), "--appendonly", "yes",
                                    "--appendfsync", appendfsync, "--save", ""])
    url = f"redis://127.0.0.1:{port}/0"
    wait_for_redis(url, check=children.check)
    return url, port


def raise_fd_limit(needed: int) -> None:
    """Many concurrent streams need many descriptors; children inherit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard == resource.RLIM_INFINITY else min(hard, max(soft, needed))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft < needed:
        print(f"warning: RLIMIT_NOFILE is {soft}, below the ~{needed} descriptors this run needs")


def cpu_seconds(proc: psutil.Process, *, tree: bool = True) -> float:
    """User + system seconds of a process; with tree, also of the children it has reaped and of
    its live descendants (a scheduler's Ray processes, say)."""
    try:
        times = proc.cpu_times()
        if not tree:
            return times.user + times.system
        total = times.user + times.system + times.children_user + times.children_system
        descendants = proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = child.cpu_times()
            total += times.user + times.system
    return total


class CpuMeter:
    """CPU seconds each named process spends between start() and stop(): other processes with
    their descendants, this one alone (its children are measuring apparatus)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {name: cpu_seconds(p, tree=p.pid != os.getpid()) for name, p in self.procs.items()}

    def start(self) -> None:
        self.before = self._read()

    def stop(self) -> dict[str, float]:
        return {name: seconds - self.before[name] for name, seconds in self._read().items()}


# -- the queue, from outside ----------------------------------------------------------------------


def submit_requests(client: redis.Redis, model: str, prompts: list[list[int]], params: list[SamplingParams],
                    *, kind: str = "interactive") -> tuple[list[str], float]:
    """XADD a RequestMessage per prompt, all in one pipeline; (request ids, time.monotonic() just
    before the pipeline was sent)."""
    messages = [RequestMessage.make(uuid.uuid4().hex, model, prompt, sp, kind=kind, arrival_time=time.time())
                for prompt, sp in zip(prompts, params, strict=True)]
    stream = KEYS.request_stream(model, kind)
    pipe = client.pipeline(transaction=False)
    for message in messages:
        pipe.xadd(stream, {"m": message.encode()})
    start = time.monotonic()
    pipe.execute()
    return [m.req_id for m in messages], start


def wait_drained(client: redis.Redis, model: str, timeout_s: float, *, children: Children | None = None,
                 kind: str = "interactive", poll_s: float = 0.05) -> None:
    """Until the model's request stream is empty. A scheduler deletes an entry in the same call
    that writes its terminal state, so one XLEN a poll says every request ended, where polling
    each request's state would load Redis (and steal the scheduler's cores on a small machine)."""
    stream = KEYS.request_stream(model, kind)
    deadline = time.monotonic() + timeout_s
    while num_left := client.xlen(stream):
        if children is not None:
            children.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{num_left} requests not ended after {timeout_s:.0f} s")
        time.sleep(poll_s)


def read_results(client: redis.Redis, req_ids: list[str]) -> dict[str, dict[bytes, bytes]]:
    """req_id -> its tf:res hash."""
    pipe = client.pipeline(transaction=False)
    for req_id in req_ids:
        pipe.hgetall(KEYS.result(req_id))
    return dict(zip(req_ids, pipe.execute(), strict=True))


def completion_tokens(record: dict[bytes, bytes]) -> int | None:
    """usage.completion_tokens of a tf:res hash that reached a terminal state."""
    return json.loads(record[b"usage"])["completion_tokens"] if b"usage" in record else None


@dataclass
class Event:
    t: float  # time.monotonic() when the bytes that completed it arrived
    seq: int
    text: str
    final: bool
    num_tokens: int = 0


def _resp_command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def listen(port: int, pattern: str, out_path: str, ready, stop) -> None:
    """PSUBSCRIBE on a bare socket and keep (arrival time, bytes) of every recv; parse later,
    so the timestamps are when Redis's bytes reached a process that does nothing else."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    chunks: list[tuple[float, bytes]] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.sendall(_resp_command(b"PSUBSCRIBE", pattern.encode()))
        first = b""
        while b"psubscribe" not in first:
            first += sock.recv(1 << 16)
        chunks.append((time.monotonic(), first))
        ready.set()
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                continue
            now = time.monotonic()
            if not data:
                break
            chunks.append((now, data))
    with open(out_path, "wb") as f:
        pickle.dump(chunks, f)


def _parse_resp(data: bytes, pos: int) -> tuple[object, int]:
    end = data.index(b"\r\n", pos)
    kind, value = data[pos:pos + 1], data[pos + 1:end]
    pos = end + 2
    if kind == b"*":
        items = []
        for _ in range(int(value)):
            item, pos = _parse_resp(data, pos)
            items.append(item)
        return items, pos
    if kind == b"$":
        size = int(value)
        if size < 0:
            return None, pos
        return data[pos:pos + size], pos + size + 2
    if kind == b":":
        return int(value), pos
    return value, pos  # + or -


def parse_listener(chunks: list[tuple[float, bytes]]) -> dict[str, list[Event]]:
    """req_id -> its events in arrival order; each timed by the recv that completed it."""
    data = b"".join(c for _, c in chunks)
    ends = list(itertools.accumulate(len(c) for _, c in chunks))
    events: dict[str, list[Event]] = {}
    pos = 0
    while pos < len(data):
        message, pos = _parse_resp(data, pos)
        if not (isinstance(message, list) and message and message[0] == b"pmessage"):
            continue
        t = chunks[bisect.bisect_left(ends, pos)][0]
        event = msgpack.unpackb(message[3], raw=False)
        final = event.get("type") == "error" or event.get("finish_reason") is not None
        events.setdefault(event["req_id"], []).append(
            Event(t, event["seq"], event.get("text") or "", final, len(event.get("token_ids") or ())))
    return events


class EventListener:
    """`listen` in its own process, subscribed to every token event (tf:ev:*) while in the
    `with` block; events() then gives what it saw."""

    def __init__(self, redis_port: int, out_path: Path) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA
        self.ready, self.stop_event = ctx.Event(), ctx.Event()
        self.out_path = out_path
        self.process = ctx.Process(target=listen, args=(redis_port, KEYS.events("*"), str(out_path),
                                                        self.ready, self.stop_event), daemon=True)

    def __enter__(self) -> EventListener:
        self.process.start()
        if not self.ready.wait(60):
            self.close()
            raise RuntimeError("the pub/sub listener did not subscribe")
        return self

    def close(self) -> None:
        self.stop_event.set()
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)

    def __exit__(self, *exc) -> None:
        self.close()

    def events(self) -> dict[str, list[Event]]:
        """req_id -> its events in arrival order (after the block)."""
        with open(self.out_path, "rb") as f:
            return parse_listener(pickle.load(f))
