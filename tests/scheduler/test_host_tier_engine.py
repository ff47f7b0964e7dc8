"""The host KV tier in the whole engine (scheduler core + real runner, float32 on a CPU): a prefix
evicted from the GPU cache comes back from the host with greedy output identical to the engine
without the tier and to transformers; a store that runs late (as on a copy stream of its own)
never reads a block handed out again; a request cancelled during its load leaves nothing behind;
a preempted request resumes from the host.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from protocol.prefix_hash import SUMMARY_HASH_BYTES, block_hashes, summary_hash
from scheduler.engine import LLMEngine
from scheduler.engine_metrics import EngineMetrics
from service.prefix_summary import PrefixSummary
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import StepResult
from tests.hf_reference import assert_greedy_matches, hf_greedy
from workers import host_kv_pool
from workers.host_kv_pool import HostKVPool, KVCopies

NUM_NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
# One block of the tiny llama checkpoint (4 layers, 2 KV heads of 16, block_size 4) in float32 is
# 4 KiB; the tier below holds 256 of them.
HOST_GIB = 1 / 1024

needs_two_ranks = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs on CUDA"
)


def conversations(seed: int, vocab: int = 512) -> list[list[int]]:
    """Three conversations' first turns (a shared system prompt, then their own), unrelated prompts
    that push them out of a small GPU cache, then each conversation's first turn sent again."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system = tokens(13)
    firsts = [system + tokens(n) for n in (19, 26, 11)]
    others = [tokens(n) for n in (40, 37, 45)]
    return firsts + others + [list(p) + tokens(3) for p in firsts]


def engine_config(folder, *, tier: bool, **overrides) -> EngineConfig:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=2,
                  max_num_batched_tokens=16, kv_offloading_size=HOST_GIB if tier else 0.0)
    config.update(overrides)
    return EngineConfig(**config)


def run_one_by_one(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt to its end before the next: (its tokens, its cached tokens) per prompt."""
    tokens, cached = [], []
    for prompt in prompts:
        [result] = engine.generate([prompt], GREEDY)
        tokens.append(result.token_ids)
        cached.append(result.num_cached_tokens)
    return tokens, cached


def test_prefixes_back_from_the_host_match_no_tier_and_transformers(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    prompts = conversations(3)
    with LLMEngine(engine_config(folder, tier=False)) as engine:
        without, cached_without = run_one_by_one(engine, prompts)
    with LLMEngine(engine_config(folder, tier=True)) as engine:
        with_tier, cached_with = run_one_by_one(engine, prompts)
        counters = engine.scheduler.host_tier.counters
        exposition = EngineMetrics(engine.scheduler, "tiny", "s0").exposition().decode()
    assert with_tier == without
    # The second turns were pushed out of the 24-block GPU cache (but for the system prompt, which
    # every first turn refreshed): the tier brings back all of their first turn's full blocks.
    assert all(c <= 12 for c in cached_without[-3:]), cached_without
    assert all(c >= len(p) - 3 - 3 for c, p in zip(cached_with[-3:], prompts[-3:], strict=True)), cached_with
    assert counters.num_loaded_blocks > 0
    assert counters.load_seconds > 0  # (timed once done: the runner never waits to time them)
    assert counters.num_hit_tokens == sum(cached_with[-3:]) - sum(cached_without[-3:])
    assert counters.num_stored_blocks > 0
    assert f'tokenfleet:external_prefix_cache_hits_total{{model_name="tiny",scheduler="s0"}} ' \
           f'{float(counters.num_hit_tokens)}' in exposition
    assert "tokenfleet:kv_offload_loaded_bytes_total" in exposition and "kv_offload_usage_perc" in exposition
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts[-3:], with_tier[-3:], strict=True):
        assert_greedy_matches(ours, hf_greedy(hf, prompt, NUM_NEW_TOKENS), allow_near_tie=True)


class LateCopies(KVCopies):
    """A step's copies that run only when the runner fences them, after the step's forward and,
    under async scheduling, after the next step's forward too: the latest a copy stream of its own
    may run them on a GPU (every kernel queued after the fence waits for them)."""

    waits = 0  # host waits for copies, over every instance

    def __init__(self, pool: HostKVPool, stores, loads) -> None:
        super().__init__(pool.device, None, None, len(loads))
        self._run = (pool, stores, loads)

    def fence(self) -> None:
        if self._run is not None:
            pool, stores, loads = self._run
            self._run = None
            pool._store(stores)
            pool._load(loads)

    def is_done(self) -> bool:
        return self._run is None

    def wait(self) -> None:
        LateCopies.waits += 1
        self.fence()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_late_store_never_reads_a_block_handed_out_again(tiny_checkpoints, monkeypatch, async_scheduling):
    """A prompt computed in one step and finished there (max_tokens 1) has its blocks' stores go with
    the next step, which admits a prompt needing more GPU blocks than are empty; its forward runs
    before the stores. Were the stored blocks handed out to it, its K/V would overwrite them first
    and the conversation would come back from the host garbled. The runner answers without waiting
    for the copies."""
    def late(pool: HostKVPool, stores, loads, after=None) -> LateCopies | None:
        return LateCopies(pool, stores, loads) if stores or loads else None

    monkeypatch.setattr(host_kv_pool.HostKVPool, "copy", late)
    monkeypatch.setattr(LateCopies, "waits", 0)
    folder = tiny_checkpoints["llama"]
    rng = random.Random(5)
    conversation = [rng.randrange(3, 512) for _ in range(32)]  # 8 blocks
    big = [rng.randrange(3, 512) for _ in range(70)]  # 18 blocks in its first step: 16 are empty
    turns = [(conversation, SamplingParams(temperature=0.0, max_tokens=1)), (big, GREEDY),
             (conversation + [7, 8, 9], GREEDY)]

    def run(tier: bool) -> tuple[list[list[int]], int]:
        config = engine_config(folder, tier=tier, max_num_batched_tokens=128,
                               async_scheduling=async_scheduling)
        with LLMEngine(config) as engine:
            results = [engine.generate([prompt], sampling)[0] for prompt, sampling in turns]
            if tier:
                assert engine.scheduler.host_tier.counters.num_loaded_blocks > 0
        return [r.token_ids for r in results], results[2].num_cached_tokens

    without, _ = run(tier=False)
    with_tier, num_cached = run(tier=True)
    assert num_cached == 32, "the conversation did not come back from the GPU and the host"
    assert with_tier == without
    assert LateCopies.waits == 0, "the runner waited for its copies before it answered"


def test_a_request_cancelled_during_its_load_leaves_nothing_behind(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    prompts = conversations(11)
    with LLMEngine(engine_config(folder, tier=True)) as engine:
        run_one_by_one(engine, prompts[:6])  # the first turns, then the prompts that evict them
        scheduler, manager = engine.scheduler, engine.scheduler.block_manager
        req_id = engine.add_request(prompts[6], GREEDY)
        output = scheduler.schedule()
        assert output.batch.kv_loads and not output.batch.works, "its prefix is not loaded from the host"
        assert scheduler.get_request(req_id).loading_step_id == output.batch.step_id
        held = [block for _, block in output.batch.kv_loads]
        engine.abort(req_id)  # the load is in flight: its blocks stay held until the step is back
        assert not any(block in manager._empty_block_ids or block in manager._free_cached for block in held)
        result = engine.executor.collect(engine.executor.submit(output.batch))
        done = scheduler.update_from_output(output, result)
        assert [(o.req_id, o.finish_reason.value) for o in done] == [(req_id, "abort")]
        assert manager.num_free_blocks == manager.num_blocks  # nothing leaked
        assert not scheduler.host_tier._pinned and not scheduler._loading
        assert not scheduler.has_unfinished_requests()
        # The same conversation afterwards loads and runs as if nothing happened.
        [again] = engine.generate([prompts[6]], GREEDY)
    with LLMEngine(engine_config(folder, tier=False)) as engine:
        [reference] = engine.generate([prompts[6]], GREEDY)
    assert again.num_cached_tokens > 0 and again.token_ids == reference.token_ids


def test_a_preempted_request_resumes_from_the_host(tiny_checkpoints):
    """A less important request is preempted by one that needs every GPU block: its blocks, prompt
    and output so far, are overwritten; it comes back loading them from the host tier."""
    folder = tiny_checkpoints["llama"]
    rng = random.Random(9)
    low, high = [rng.randrange(3, 512) for _ in range(30)], [rng.randrange(3, 512) for _ in range(56)]
    sampling = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(tier: bool) -> tuple[dict[str, list[int]], int, int]:
        with LLMEngine(engine_config(folder, tier=tier, num_kv_blocks=16)) as engine:
            tokens = {"low": [], "high": []}
            engine.add_request(low, sampling, req_id="low", priority=1)
            while len(tokens["low"]) < 4:  # its prompt and a few tokens computed
                for out in engine.step():
                    tokens[out.req_id].extend(out.new_token_ids)
            engine.add_request(high, sampling, req_id="high", priority=0)
            request = engine.scheduler.get_request("low")
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.req_id].extend(out.new_token_ids)
            # (Only "low" can load anything: nothing of "high" was ever computed before it.)
            num_loaded = engine.scheduler.host_tier.counters.num_loaded_blocks if tier else 0
            return tokens, num_loaded, request.num_preemptions

    without, _, num_preemptions = run(tier=False)
    with_tier, num_loaded, num_preemptions_with_tier = run(tier=True)
    assert num_preemptions == num_preemptions_with_tier == 1, "no preemption was forced"
    # Its prompt and the output computed before its preemption: 8 full blocks, loaded back.
    assert num_loaded >= 8, "the preempted request was not loaded back from the host"
    assert with_tier == without


def test_async_scheduling_with_the_tier_matches_without(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    prompts = conversations(17)
    with LLMEngine(engine_config(folder, tier=False, async_scheduling=True)) as engine:
        without, _ = run_one_by_one(engine, prompts)
    with LLMEngine(engine_config(folder, tier=True, async_scheduling=True)) as engine:
        with_tier, cached = run_one_by_one(engine, prompts)
        assert engine.scheduler.host_tier.counters.num_loaded_blocks > 0
    assert with_tier == without and all(cached[-3:])


def test_an_fp8_kv_cache_comes_back_from_the_host_byte_for_byte(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    prompts = conversations(21)
    with LLMEngine(engine_config(folder, tier=False, kv_cache_dtype="fp8")) as engine:
        without, _ = run_one_by_one(engine, prompts)
    with LLMEngine(engine_config(folder, tier=True, kv_cache_dtype="fp8")) as engine:
        with_tier, cached = run_one_by_one(engine, prompts)
        assert engine.executor.runner.kv_caches.dtype == torch.float8_e4m3fn
        assert engine.scheduler.host_tier.counters.num_loaded_blocks > 0
    assert with_tier == without and all(cached[-3:])


def test_a_failed_group_leaves_no_copy_holding_a_block(tiny_checkpoints):
    """A worker group dies with a load in flight: every running request is preempted, the tier
    forgets what the dead group's host pools held, and no GPU block stays held."""
    prompts = conversations(13)
    with LLMEngine(engine_config(tiny_checkpoints["llama"], tier=True)) as engine:
        run_one_by_one(engine, prompts[:6])
        scheduler, manager = engine.scheduler, engine.scheduler.block_manager
        req_id = engine.add_request(prompts[6], GREEDY)
        output = scheduler.schedule()
        assert output.batch.kv_loads
        scheduler.preempt_all_running()  # (the engine's recovery: the step died with the group)
        assert manager.num_free_blocks == manager.num_blocks
        assert scheduler.host_tier.num_used_blocks == 0 and not scheduler._loading
        engine.executor.restart()
        tokens = []  # it runs again, recomputing what the tier forgot
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() if out.req_id == req_id for t in out.new_token_ids]
    with LLMEngine(engine_config(tiny_checkpoints["llama"], tier=False)) as engine:
        [reference] = engine.generate([prompts[6]], GREEDY)
    assert tokens == reference.token_ids


def test_a_step_of_copies_alone_returns_an_empty_result(tiny_checkpoints):
    with LLMEngine(engine_config(tiny_checkpoints["llama"], tier=True)) as engine:
        [result] = engine.generate([list(range(3, 40))], SamplingParams(temperature=0.0, max_tokens=1))
        scheduler = engine.scheduler
        # Its last step registered its last full blocks: their stores go with the next step, alone.
        assert scheduler.block_manager.newly_registered
        output = scheduler.schedule()
        assert output.batch.kv_stores and not output.batch.works
        result = engine.executor.collect(engine.executor.submit(output.batch))
        assert isinstance(result, StepResult) and result.sampled == []
        scheduler.update_from_output(output, result)
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
        assert scheduler.host_tier.counters.num_stored_blocks == 36 // 4


def test_the_prefix_summary_names_host_blocks_after_gpu_blocks(tiny_checkpoints):
    prompts = conversations(4)
    with LLMEngine(engine_config(tiny_checkpoints["llama"], tier=True)) as engine:
        run_one_by_one(engine, prompts[:6])  # the first turns, pushed out to the host by the last three
        summary = PrefixSummary(engine.scheduler)
        blob = summary.build()
        fields = summary.heartbeat_fields()
    hashes = [blob[i:i + SUMMARY_HASH_BYTES] for i in range(0, len(blob), SUMMARY_HASH_BYTES)]
    gpu, host = hashes[:fields["prefix_summary_gpu_hashes"]], hashes[fields["prefix_summary_gpu_hashes"]:]
    first_turn = {summary_hash(h) for h in block_hashes(prompts[0], 4)}
    last_prompt = {summary_hash(h) for h in block_hashes(prompts[5], 4)}
    assert last_prompt <= set(gpu) and first_turn <= set(host) and not first_turn & set(gpu)


@pytest.mark.slow
@needs_two_ranks
def test_prefixes_back_from_the_host_match_no_tier_at_tp2(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    prompts = conversations(3)
    with LLMEngine(engine_config(folder, tier=False, tp=2)) as engine:
        without, _ = run_one_by_one(engine, prompts)
    with LLMEngine(engine_config(folder, tier=True, tp=2)) as engine:
        with_tier, cached = run_one_by_one(engine, prompts)
        assert engine.executor.num_host_kv_blocks > 0
        assert engine.scheduler.host_tier.counters.num_loaded_blocks > 0
    assert with_tier == without and all(cached[-3:])


@pytest.mark.slow
@needs_two_ranks
def test_prefixes_back_from_the_host_match_no_tier_with_two_pipeline_stages(tiny_checkpoints):
    folder = tiny_checkpoints["llama"]
    prompts = conversations(5)
    with LLMEngine(engine_config(folder, tier=False, pp=2)) as engine:
        without, _ = run_one_by_one(engine, prompts)
    with LLMEngine(engine_config(folder, tier=True, pp=2)) as engine:
        with_tier, cached = run_one_by_one(engine, prompts)
        assert engine.scheduler.host_tier.counters.num_loaded_blocks > 0
    assert with_tier == without and all(cached[-3:])
