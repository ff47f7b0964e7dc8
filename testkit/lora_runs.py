"""`scripts/bench_lora_gpu.py`'s measurements: a burst spread over adapters, batch-1 decode on an
adapter, an adapter's first load. Each takes an engine that the script built."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.engine_runs import warm_up
from testkit.roofline import sync
from testkit.workloads import Workload, greedy, warmup_prompts


def burst_output_rate(engine: LLMEngine, workload: Workload, lora_names: list[str | None],
                      device: torch.device) -> float:
    """Output tok/s of every request added at once, request i on lora_names[i % len(lora_names)]."""
    sync(device)
    start = time.perf_counter()
    for index, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
        engine.add_request(prompt, greedy(max_tokens), lora_name=lora_names[index % len(lora_names)])
    num_output = 0
    while engine.has_unfinished_requests():
        num_output += sum(len(out.new_token_ids) for out in engine.step())
    sync(device)
    return num_output / (time.perf_counter() - start)


def decode_ms_per_token(engine: LLMEngine, vocab_size: int, device: torch.device, lora_name: str | None,
                        num_prompt: int = 128, num_output: int = 128) -> float:
    """Milliseconds per output token of one request alone on `lora_name`, prefill left out (best of 2)."""
    rng = random.Random(1)
    best = float("inf")
    for _ in range(2):
        engine.add_request([rng.randrange(vocab_size) for _ in range(num_prompt)], greedy(num_output),
                           lora_name=lora_name)
        engine.step()  # the prefill and the first token
        sync(device)
        start, count = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            count += sum(len(out.new_token_ids) for out in engine.step())
        sync(device)
        best = min(best, (time.perf_counter() - start) / max(count, 1))
    return best * 1e3


def first_load_ms(engine: LLMEngine, name: str, path: str, vocab_size: int) -> float:
    """An adapter registered now and called once: the runner's time to read it from disk and copy
    it into its slot (in-process engines only)."""
    engine.add_lora(name, path)
    engine.generate([[1 + i % (vocab_size - 1) for i in range(16)]], greedy(1), lora_names=[name])
    return engine.executor.runner.lora.last_load_ms


def lora_engine(folder: Path, args, **lora) -> LLMEngine:
    """The script's engine on --device/--dtype: the base alone, or with the given LoRA flags."""
    config = EngineConfig.for_device(torch.device(args.device).type, model=str(folder), device=args.device,
                                     dtype=args.dtype, num_kv_blocks=512 if args.smoke else None, **lora)
    return LLMEngine(config, load_tokenizer_files=False)


def measure(engine: LLMEngine, args, workload, vocab: int, names: list[str | None]) -> dict:
    """Burst and batch-1 decode on `names` (None: the base), after a warm-up that fills the slots."""
    device = torch.device(args.device)
    warm_up(engine, vocab)
    if names[0] is not None:  # every adapter into its slot, the LoRA products' kernels compiled
        prompts = warmup_prompts(vocab, engine.max_model_len)
        engine.generate([prompts[i % len(prompts)] for i in range(len(names))], greedy(8), lora_names=names)
    result = {"burst": burst_output_rate(engine, workload, names, device),
              "decode": decode_ms_per_token(engine, vocab, device, names[0])}
    if names[0] is not None:
        result["decode_base"] = decode_ms_per_token(engine, vocab, device, None)
    return result
