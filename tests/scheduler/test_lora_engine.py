"""LoRA adapters through the whole in-process engine, against transformers + peft (PEFT's own
unmerged forward) on the same base and adapter files: greedy tokens identical, each adapter
alone and all of them mixed with the base in the same steps."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from scheduler.engine_metrics import EngineMetrics
from shared.config import EngineConfig
from shared.errors import InvalidRequestError, LoraAdapterError, ModelLoadError
from shared.sampling import SamplingParams
from testkit.lora_adapters import load_hf_with_adapter, make_random_adapter
from tests.conftest import LORA_SPECS
from tests.hf_reference import assert_greedy_matches, hf_greedy
from workers.lora.layers import LoraProjection

NUM_NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
NAMES = [None, *LORA_SPECS]  # the base, then each adapter


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


PROMPTS = _prompts(7, [9, 23, 5, 30])  # one per NAMES entry, different lengths


@pytest.fixture(scope="module")
def references(tiny_checkpoints, lora_adapters):
    """name -> transformers(+peft)'s greedy continuation of every prompt on it."""
    base = tiny_checkpoints["llama"]
    refs = {}
    for name in NAMES:
        model = (AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval() if name is None
                 else load_hf_with_adapter(base, lora_adapters[name]))
        refs[name] = [hf_greedy(model, prompt, NUM_NEW_TOKENS) for prompt in PROMPTS]
    return refs


def _engine(base, adapters, **overrides) -> LLMEngine:
    config = dict(model=str(base), dtype="float32", block_size=4, num_kv_blocks=128, max_num_seqs=4,
                  max_num_batched_tokens=32, enable_lora=True, max_loras=3, max_lora_rank=16,
                  lora_modules={name: str(path) for name, path in adapters.items()})
    config.update(overrides)
    return LLMEngine(EngineConfig(**config), load_tokenizer_files=False)


def test_each_adapter_alone_matches_transformers_peft(tiny_checkpoints, lora_adapters, references) -> None:
    with _engine(tiny_checkpoints["llama"], lora_adapters) as engine:
        for name in NAMES:
            results = engine.generate(PROMPTS, GREEDY, lora_names=[name] * len(PROMPTS))
            for result, ref in zip(results, references[name], strict=True):
                assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)
    # The adapters do change the tokens (else the test above could not fail).
    assert all(references[name][0].token_ids != references[None][0].token_ids for name in LORA_SPECS)


def test_one_batch_mixing_three_adapters_and_the_base_matches(tiny_checkpoints, lora_adapters,
                                                              references) -> None:
    """Every prompt on every adapter and the base, 16 requests, all in the same steps."""
    prompts = [p for p in PROMPTS for _ in NAMES]
    names = [n for _ in PROMPTS for n in NAMES]
    steps_mixing = []
    base = tiny_checkpoints["llama"]
    with _engine(base, lora_adapters, max_num_seqs=16, max_num_batched_tokens=128) as engine:
        original = engine.executor.submit

        def spy(batch):
            steps_mixing.append(len({w.lora_slot for w in batch.works}))
            return original(batch)

        engine.executor.submit = spy
        results = engine.generate(prompts, GREEDY, lora_names=names)
    assert max(steps_mixing) == 4  # base + three adapters in one step
    for index, result in enumerate(results):
        ref = references[names[index]][index // len(NAMES)]
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)


@pytest.mark.slow  # (tests/workers/test_lora_graphs.py runs the dense path through the graph branches)
def test_the_dense_path_gives_the_same_tokens(tiny_checkpoints, lora_adapters, references) -> None:
    """The dense path (CUDA's, which its decode graphs replay), through the whole engine here."""
    prompts = [p for p in PROMPTS for _ in NAMES]
    names = [n for _ in PROMPTS for n in NAMES]
    base = tiny_checkpoints["llama"]
    with _engine(base, lora_adapters, max_num_seqs=16, max_num_batched_tokens=128) as engine:
        engine.executor.runner.lora.batch.use_dense = True
        results = engine.generate(prompts, GREEDY, lora_names=names)
    for index, result in enumerate(results):
        ref = references[names[index]][index // len(NAMES)]
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)


def test_one_slot_for_three_adapters_swaps_them_in_and_out(tiny_checkpoints, lora_adapters,
                                                           references) -> None:
    """max_loras=1, max_cpu_loras=1: requests on other adapters wait for the slot, an adapter whose
    turn comes back is read from disk again, and the tokens stay the same."""
    first = NAMES[1]
    with _engine(tiny_checkpoints["llama"], lora_adapters, max_loras=1, max_cpu_loras=1) as engine:
        results = engine.generate(PROMPTS, GREEDY, lora_names=NAMES)
        for index, (result, name) in enumerate(zip(results, NAMES, strict=True)):
            assert_greedy_matches(result.token_ids, references[name][index], allow_near_tie=True)
        again = engine.generate(PROMPTS[:1], GREEDY, lora_names=[first])[0]
        assert_greedy_matches(again.token_ids, references[first][0], allow_near_tie=True)
        assert engine.scheduler.lora_slots.num_loads == 4  # the first one came back
        first_id = engine.scheduler.lora_slots.adapters[first].adapter_id
        assert list(engine.executor.runner.lora.host) == [first_id]  # read again: the host keeps one
        metrics = EngineMetrics(engine.scheduler, "tiny", "s1").exposition().decode()
    assert f'tokenfleet:lora_requests_total{{lora_name="{first}",model_name="tiny",scheduler="s1"}} 2.0' \
        in metrics
    assert 'tokenfleet:lora_adapters_loaded{model_name="tiny",scheduler="s1"} 1.0' in metrics


def test_prefix_cache_is_shared_within_an_adapter_never_across(tiny_checkpoints, lora_adapters,
                                                                references) -> None:
    prompt = PROMPTS[3]  # 30 tokens: 7 full blocks of 4 can be found
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    first, second = list(LORA_SPECS)[:2]
    with _engine(tiny_checkpoints["llama"], lora_adapters) as engine:
        manager = engine.scheduler.block_manager

        def hits(name):
            before = manager.prefix_cache_hits
            engine.generate([prompt], one, lora_names=[name])
            return manager.prefix_cache_hits - before

        assert hits(first) == 0
        assert hits(second) == 0  # the same tokens on another adapter: other K/V
        assert hits(None) == 0  # nor the base
        assert hits(first) == 28
        assert hits(None) == 28
        # ...and the cached blocks give the adapter's own tokens.
        result = engine.generate([prompt], GREEDY, lora_names=[second])[0]
    assert_greedy_matches(result.token_ids, references[second][3], allow_near_tie=True)


def test_adapters_are_loaded_and_unloaded_at_runtime(tiny_checkpoints, lora_adapters, references) -> None:
    name = "rank8-ko-gate"
    with _engine(tiny_checkpoints["llama"], {}) as engine:
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'late'"):
            engine.add_request(PROMPTS[0], GREEDY, lora_name="late")
        engine.add_lora("late", str(lora_adapters[name]))
        result = engine.generate([PROMPTS[1]], GREEDY, lora_names=["late"])[0]
        assert_greedy_matches(result.token_ids, references[name][1], allow_near_tie=True)
        engine.remove_lora("late")
        assert engine.lora_names() == []
        with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'late'"):
            engine.add_request(PROMPTS[0], GREEDY, lora_name="late")
        # The same name on another adapter is another adapter: no stale tensors, no stale K/V.
        engine.add_lora("late", str(lora_adapters["rank4-qv"]))
        result = engine.generate([PROMPTS[1]], GREEDY, lora_names=["late"])[0]
        assert_greedy_matches(result.token_ids, references["rank4-qv"][1], allow_near_tie=True)


def test_a_bad_adapter_is_refused_and_the_running_requests_go_on(tiny_checkpoints, lora_adapters,
                                                                  references, tmp_path) -> None:
    big = make_random_adapter(tiny_checkpoints["llama"], tmp_path / "r32", rank=32, target_modules=["q_proj"])
    with _engine(tiny_checkpoints["llama"], lora_adapters) as engine:
        req_id = engine.add_request(PROMPTS[2], GREEDY, lora_name="rank4-qv")
        tokens = [t for out in engine.step() for t in out.new_token_ids]
        with pytest.raises(LoraAdapterError, match="rank 32 is over max_lora_rank=16"):
            engine.add_lora("big", str(big))
        with pytest.raises(LoraAdapterError, match="no such folder"):
            engine.add_lora("gone", str(tmp_path / "nowhere"))
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() if out.req_id == req_id for t in out.new_token_ids]
    assert_greedy_matches(tokens, references["rank4-qv"][2], allow_near_tie=True)


def test_without_enable_lora_nothing_is_wrapped_and_adapters_are_refused(tiny_checkpoints) -> None:
    with _engine(tiny_checkpoints["llama"], {}, enable_lora=False) as engine:
        model = engine.executor.runner.model
        assert not any(isinstance(m, LoraProjection) for m in model.modules())
        assert engine.executor.runner.lora is None
        with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
            engine.add_request(PROMPTS[0], GREEDY, lora_name="rank4-qv")


def test_adapters_on_quantized_weights_are_refused_at_start(tiny_checkpoints) -> None:
    with pytest.raises(ModelLoadError, match="unquantized weights only"):
        _engine(tiny_checkpoints["llama"], {}, quantization="int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path: decode graphs with adapters")
def test_cuda_graphs_with_adapters_match_transformers_peft(tiny_checkpoints, lora_adapters,
                                                          references) -> None:
    prompts = [p for p in PROMPTS for _ in NAMES]
    names = [n for _ in PROMPTS for n in NAMES]
    with _engine(tiny_checkpoints["llama"], lora_adapters, device="cuda", max_num_seqs=16,
                 max_num_batched_tokens=128) as engine:
        runner = engine.executor.runner
        assert runner.lora.is_dense and runner.decode_graphs is not None and runner.decode_graphs.graphs
        results = engine.generate(prompts, GREEDY, lora_names=names)
    for index, result in enumerate(results):
        ref = references[names[index]][index // len(NAMES)]
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tp2_and_pp2_mixed_adapters_match_transformers_peft(tiny_checkpoints, lora_adapters, references,
                                                            tp, pp) -> None:
    """Two ranks. TP: column-parallel B split by output rows, row-parallel A by input columns.
    PP: each stage holds its own layers' slots."""
    prompts = [p for p in PROMPTS for _ in NAMES]
    names = [n for _ in PROMPTS for n in NAMES]
    with _engine(tiny_checkpoints["llama"], lora_adapters, tp=tp, pp=pp, max_num_seqs=16,
                 max_num_batched_tokens=128) as engine:
        results = engine.generate(prompts, GREEDY, lora_names=names)
    for index, result in enumerate(results):
        assert_greedy_matches(result.token_ids, references[names[index]][index // len(NAMES)],
                              allow_near_tie=True)


@pytest.mark.slow
def test_smollm2_with_a_random_adapter_matches_transformers_peft(smollm2, tmp_path) -> None:
    adapter = make_random_adapter(smollm2, tmp_path / "smol", rank=8, target_modules=["q_proj", "v_proj",
                                                                                    "down_proj"], seed=3)
    prompt = _prompts(11, [20])[0]
    ref = hf_greedy(load_hf_with_adapter(smollm2, adapter), prompt, 6)
    base_ref = hf_greedy(AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval(), prompt, 6)
    assert ref.token_ids != base_ref.token_ids
    engine = LLMEngine(EngineConfig(model=str(smollm2), dtype="float32", num_kv_blocks=32, enable_lora=True,
                                    lora_modules={"smol": str(adapter)}, max_lora_rank=8),
                       load_tokenizer_files=False)
    with engine:
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        results = engine.generate([prompt, prompt], greedy, lora_names=["smol", None])
    assert_greedy_matches(results[0].token_ids, ref, allow_near_tie=True)
    assert_greedy_matches(results[1].token_ids, base_ref, allow_near_tie=True)
