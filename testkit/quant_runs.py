"""The engines scripts/bench_quant.py compares, built as `tokenfleet scheduler` builds them:
one per weight method on the same checkpoint (`measure`: speed, weight bytes, greedy outputs
and logits for accuracy), bf16 under the quantized methods' budget (`bf16_refused_under`), the
long-context run with a bf16 and an FP8 KV cache (`kv_long_context`), and perplexity on a real
checkpoint (`accuracy`). The script's docstring says what each figure is."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from testkit.engine_runs import engine_decode_latency, run_engine_workload, warm_up
from testkit.random_models import LLAMA3_8B, TINY_LLAMA
from testkit.runs import log
from testkit.workloads import uniform_workload
from workers.layers import fp8_tuning

REPO = Path(__file__).resolve().parents[1]  # (its README.md is the accuracy text)
# The smoke model's linear layers outweigh its embeddings, as Llama-3-8B's do, so that the 60%
# budget binds the same way.
SMOKE_LLAMA = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 512, "vocab_size": 256}
# The long-context workload's window: 8,192-token prompts and 512 outputs.
LONG_PROMPT, LONG_OUTPUT = 8192, 512


def engine_config(folder: Path, args, quantization: str | None, **overrides) -> EngineConfig:
    overrides.setdefault("max_model_len", 2048 if args.smoke else 8192)
    overrides.setdefault("max_num_seqs", 64 if args.smoke else 512)
    # for_device: the device's defaults for the rest (async scheduling on CUDA), as `tokenfleet
    # scheduler` builds them: the batch-1 latency is the one of the path users take.
    return EngineConfig.for_device(torch.device(args.device).type, model=str(folder), device=args.device,
                                   dtype=args.dtype, quantization=quantization, **overrides)


def greedy_outputs_and_logits(engine: LLMEngine,
                              prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    outputs = [r.token_ids for r in engine.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))]
    runner = engine.executor.runner
    prompt = prompts[0]
    blocks = list(range(-(-len(prompt) // runner.block_size)))
    work = SequenceWork("logits", prompt, 0, blocks, True, SamplingParams(temperature=0.0))
    logits = runner.forward(StepBatch(0, [work]), use_graphs=False)[0].float().cpu()
    return outputs, logits


# --methods name -> (quantization, kv_cache_dtype) of its engine; "fp8+kv8": FP8 weights and KV cache.
WEIGHT_METHODS = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "int8": ("int8", "auto"),
                  "fp8+kv8": ("fp8", "fp8"), "fp8-no-w8a8": ("fp8", "auto")}
# Methods whose FP8 tuner leaves out the Triton FP8 x FP8 GEMM (as served before it was measured).
NO_W8A8_METHODS = {"fp8-no-w8a8"}


def measure(method: str, folder: Path, args, workload, vocab_size: int, budget: int,
            prompts: list[list[int]]) -> dict:
    quantization, kv_cache_dtype = WEIGHT_METHODS[method]
    result: dict = {"method": method}
    try_w8a8 = method not in NO_W8A8_METHODS
    if fp8_tuning.TRY_W8A8 != try_w8a8:
        fp8_tuning.TRY_W8A8 = try_w8a8
        fp8_tuning.forget()  # the table measured without (or with) the w8a8 candidate no longer holds
    overrides = {"kv_cache_dtype": kv_cache_dtype}
    if quantization is not None:
        overrides["max_weight_bytes_per_rank"] = budget
    try:
        engine = LLMEngine(engine_config(folder, args, quantization, **overrides), load_tokenizer_files=False)
    except ModelLoadError as exc:  # int8 on CUDA
        result["refused"] = str(exc)
        return result
    try:
        result["weight_bytes"] = engine.executor.runner.weight_bytes
        result["outputs"], result["logits"] = greedy_outputs_and_logits(engine, prompts)
        warm_up(engine, vocab_size)
        run = run_engine_workload(engine, workload, args.engine_seconds, torch.device(args.device))
        result["output_rate"] = run.output_rate
        result["partial"] = run.partial_limit_s is not None
        result["ms_per_token"] = engine_decode_latency(engine, vocab_size, torch.device(args.device)) * 1e3
    finally:
        engine.close()
        del engine
        gc.collect()
    return result


def bf16_refused_under(folder: Path, args, budget: int) -> str:
    try:
        LLMEngine(engine_config(folder, args, None, max_weight_bytes_per_rank=budget),
                  load_tokenizer_files=False).close()
    except ModelLoadError as exc:
        return f"refused: {str(exc)[:120]}"
    return "LOADED (the budget did not bind)"


def kv_long_context(folder: Path, args) -> list[dict]:
    """bf16 weights, a bf16 then an FP8 KV cache: the long-context workload's tok/s and blocks."""
    prompt, output = (256, 32) if args.smoke else (LONG_PROMPT, LONG_OUTPUT)
    num_requests = 8 if args.smoke else 64
    shape = SMOKE_LLAMA if args.smoke else LLAMA3_8B
    workload = uniform_workload(num_requests, shape["vocab_size"], prompt_lens=(prompt, prompt),
                                output_lens=(output, output))
    found = []
    for kv in ("auto", "fp8"):
        config = engine_config(folder, args, None, kv_cache_dtype=kv, max_model_len=prompt + output,
                               max_num_seqs=num_requests)
        engine = LLMEngine(config, load_tokenizer_files=False)
        try:
            warm_up(engine, shape["vocab_size"])
            run = run_engine_workload(engine, workload, args.engine_seconds, torch.device(args.device))
            found.append({"kv": kv, "blocks": engine.executor.num_kv_blocks, "output_rate": run.output_rate,
                          "seconds": run.seconds, "partial": run.partial_limit_s is not None,
                          **decode_phase(run)})
        finally:
            engine.close()
            del engine
            gc.collect()
        log(f"KV {kv}: {found[-1]['output_rate']:,.0f} output tok/s, {found[-1]['blocks']:,} blocks")
    return found


def decode_phase(run) -> dict:
    """The run's decode-only part: from the step that gave the last request its first token (every
    prompt prefilled) to the end, where each step reads every request's whole context. Its
    output tok/s is what an FP8 cache can speed up; the prefill before it is bound by compute."""
    first_tokens = [times[0] for times in run.token_times.values() if times]
    if not first_tokens:
        return {"decode_rate": None, "decode_seconds": None}
    begin = max(first_tokens)
    end = max(times[-1] for times in run.token_times.values() if times)
    # tokens of the steps after `begin` (one per request per step: greedy, no speculation)
    tokens = sum(sum(1 for t in times if t > begin) for times in run.token_times.values())
    return {"decode_rate": tokens / (end - begin) if end > begin else None, "decode_seconds": end - begin}


ACCURACY_RUNS = (("bf16", "auto"), ("fp8", "auto"), ("int8", "auto"), ("bf16", "fp8"), ("fp8", "fp8"),
                 ("bf16", "fp8 unit scales"), ("fp8", "fp8 unit scales"))
# A KV cache column -> its engine's fields: "fp8" as served (measured scales where the checkpoint
# has none), "fp8 unit scales" as before they were measured (--calculate-kv-scales off).
KV_RUNS = {"auto": {"kv_cache_dtype": "auto"}, "fp8": {"kv_cache_dtype": "fp8"},
           "fp8 unit scales": {"kv_cache_dtype": "fp8", "calculate_kv_scales": False}}


def accuracy(model: Path, methods: list[str], args) -> list[dict]:
    """Per (weights, KV cache): README.md's perplexity (2,048 tokens, windows of 512) and greedy
    agreement with the baseline over 16 README prompts x 32 tokens."""
    from transformers import AutoTokenizer

    from testkit.perplexity import perplexity
    from workers.model_runner import ModelRunner
    from workers.parallel import SINGLE_DEVICE

    token_ids = AutoTokenizer.from_pretrained(model)((REPO / "README.md").read_text())["input_ids"]
    prompts = [token_ids[i * 97 : i * 97 + 48] for i in range(16)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    found = []
    for method, kv in ACCURACY_RUNS:
        if method not in methods:
            continue
        quantization = None if method == "bf16" else method
        config = engine_config(model, args, quantization, num_kv_blocks=256, max_num_seqs=16, **KV_RUNS[kv])
        try:
            runner = ModelRunner(config, SINGLE_DEVICE)
        except ModelLoadError as exc:
            found.append({"method": method, "kv": kv, "refused": str(exc)})
            continue
        ppl = perplexity(runner, token_ids[:2048])
        runner.close()
        with LLMEngine(config, load_tokenizer_files=False) as engine:
            outputs = [r.token_ids for r in engine.generate(prompts, greedy)]
        found.append({"method": method, "kv": kv, "perplexity": ppl, "outputs": outputs})
    return found
