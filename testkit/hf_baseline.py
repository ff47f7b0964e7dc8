"""The transformers baselines of the GPU benchmarks, on the same workload as the engine:
`generate` in static left-padded batches (time-bounded), its batch-1 decode latency, and
transformers' own continuous batching (its continuous-batching manager)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from testkit.roofline import sync
from testkit.workloads import Workload


@dataclass
class HfRun:
    """What one baseline produced: useful tokens only (padding and tokens past a request's own
    length are not counted), over the time it ran."""

    num_output_tokens: int
    num_total_tokens: int  # output tokens + prompts of the requests counted
    seconds: float
    notes: str

    @property
    def output_rate(self) -> float:
        return self.num_output_tokens / self.seconds

    @property
    def total_rate(self) -> float:
        return self.num_total_tokens / self.seconds


def hf_generate(model, prompts: list[list[int]], num_new: int, device: torch.device) -> None:
    """One static, left-padded batch making exactly num_new tokens per row."""
    width = max(map(len, prompts))
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             do_sample=False, max_new_tokens=num_new, min_new_tokens=num_new,
                             eos_token_id=None, pad_token_id=0)
    if out.shape[1] - width != num_new:
        raise RuntimeError(f"transformers made {out.shape[1] - width} tokens, not {num_new}")


def run_hf_static(model, workload: Workload, batch_size: int, seconds_limit: float,
                  device: torch.device) -> HfRun:
    """Batches of batch_size in workload order, each making its longest request's tokens; no
    batch starts that would end past seconds_limit (the last batch's time is the guess)."""
    hf_generate(model, [workload.prompts[0][:16]], 4, device)  # warm-up
    batches = [range(i, min(i + batch_size, len(workload.prompts)))
               for i in range(0, len(workload.prompts), batch_size)]
    elapsed, done, last, num_batches = 0.0, [], 0.0, 0
    for indices in batches:
        if done and elapsed + last > seconds_limit:  # this batch would end past the limit
            break
        sync(device)
        start = time.perf_counter()
        hf_generate(model, [workload.prompts[i] for i in indices],
                    max(workload.max_tokens[i] for i in indices), device)
        sync(device)
        last = time.perf_counter() - start
        elapsed += last
        done.extend(indices)
        num_batches += 1
    num_output = sum(workload.max_tokens[i] for i in done)
    num_total = num_output + sum(len(workload.prompts[i]) for i in done)
    notes = (f"{num_batches} of {len(batches)} batches of {batch_size} "
             f"({len(done)} requests) within the {seconds_limit:.0f} s bound; useful tokens only")
    return HfRun(num_output, num_total, elapsed, notes)


def hf_decode_latency(model, vocab_size: int, device: torch.device, num_prompt: int = 128,
                      num_output: int = 32) -> float:
    """Seconds per output token of one request (random prompt ids), after a warm-up."""
    rng = random.Random(1)
    prompt = [rng.randrange(vocab_size) for _ in range(num_prompt)]
    hf_generate(model, [prompt], 4, device)  # warm-up
    sync(device)
    start = time.perf_counter()
    hf_generate(model, [prompt], num_output, device)
    sync(device)
    return (time.perf_counter() - start) / num_output


def run_hf_continuous(model, workload: Workload, seconds_limit: float, device: torch.device) -> HfRun:
    """transformers' continuous batching: every request at once, results until done or the limit."""
    import inspect

    from transformers import GenerationConfig

    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_tokens),
                                         pad_token_id=0)
    generation_config.eos_token_id = -1  # EOS off (set after construction: no validation of -1)
    cm_params = inspect.signature(model.continuous_batching_context_manager).parameters
    cm_kwargs = {"generation_config": generation_config, "block": True, "timeout": 30}
    if "warmup" in cm_params:
        cm_kwargs["warmup"] = True
    with model.continuous_batching_context_manager(**cm_kwargs) as manager:
        add_params = inspect.signature(manager.add_request).parameters
        eos = {"eos_token_id": -1} if "eos_token_id" in add_params else {}
        sync(device)
        start = time.perf_counter()
        wanted = {}
        for i, (prompt, num_new) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
            req_id = manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=num_new, **eos)
            wanted[req_id or f"r{i}"] = i
        num_output = num_prompt = finished = 0
        last = start
        while finished < len(wanted) and time.perf_counter() - start < seconds_limit:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous-batching loop died")
                continue
            if result.is_finished() and result.request_id in wanted:
                i = wanted[result.request_id]
                num_output += min(len(result.generated_tokens), workload.max_tokens[i])
                num_prompt += len(workload.prompts[i])
                finished += 1
                last = time.perf_counter()
        if finished < len(wanted) and "hard_stop" in inspect.signature(manager.stop).parameters:
            manager.stop(block=True, timeout=30, hard_stop=True)
    elapsed = last - start
    if not finished:
        raise RuntimeError(f"no request finished within {seconds_limit:.0f} s")
    notes = (f"{finished} of {len(wanted)} requests (the workload's first {len(wanted)}) finished "
             f"in {elapsed:.0f} s (bound {seconds_limit:.0f} s); rate over finished requests")
    return HfRun(num_output, num_output + num_prompt, elapsed, notes)
