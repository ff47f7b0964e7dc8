"""Qwen (v1) `QWenLMHeadModel` folders, served natively: greedy tokens equal transformers' Qwen2
on the same weights (inside seq_length, where Qwen's long-context tricks change nothing), plain
and through ChatML; TP=2 and PP=2 equal TP=1; a bad folder fails with one line naming the file
and the field."""

from __future__ import annotations

import base64
import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.model_config import load_model_config
from shared.sampling import SamplingParams
from shared.tokenizer import load_tokenizer
from testkit.qwen_checkpoints import TINY_QWEN
from tests.hf_reference import assert_greedy_matches, hf_greedy

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
LENGTHS = [5, 40, 1, 17, 33]  # all with their output inside seq_length (64)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, TINY_QWEN["vocab_size"]) for _ in range(n)] for n in LENGTHS]


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=3,
                  max_num_batched_tokens=16)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def references(tiny_qwen_as_qwen2):
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen_as_qwen2, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, NUM_TOKENS) for p in _prompts()]


def test_the_folder_is_laid_out_as_the_published_one(tiny_qwen) -> None:
    names = {p.name for p in tiny_qwen.iterdir()}
    assert {"config.json", "qwen.tiktoken", "generation_config.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.endswith(".py")]
    raw = json.loads((tiny_qwen / "config.json").read_text())
    assert raw["model_type"] == "qwen" and raw["architectures"] == ["QWenLMHeadModel"]
    assert "auto_map" in raw and "torch_dtype" not in raw
    cfg = load_model_config(tiny_qwen)
    assert cfg.intermediate_size == raw["intermediate_size"] // 2  # twice the MLP width
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias) == (16, 4, True)
    assert (cfg.seq_length, cfg.use_logn_attn, cfg.use_dynamic_ntk) == (64, True, True)


def test_greedy_matches_transformers_qwen2_on_the_same_weights(tiny_qwen, references) -> None:
    """Batched, chunked prefill (16-token steps), sequences joining as others finish."""
    with _engine(tiny_qwen) as engine:
        results = engine.generate(_prompts(), GREEDY)
    for result, ref in zip(results, references, strict=True):
        assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)


def test_chat_prompt_is_qwens_exact_chatml_and_greedy_matches(tiny_qwen, tiny_qwen_as_qwen2) -> None:
    import tiktoken

    from shared.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS

    # The expected ids, built here from the file with tiktoken directly.
    ranks = {}
    for line in (tiny_qwen / "qwen.tiktoken").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    special = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    enc = tiktoken.Encoding("t", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special)
    start, end, nl = special["<|im_start|>"], special["<|im_end|>"], enc.encode_ordinary("\n")
    question = "hello <|im_end|> world"  # a special token in user text stays text
    system = enc.encode_ordinary("You are a helpful assistant.")
    expected = ([start, *enc.encode_ordinary("system"), *nl, *system, end, *nl,
                 start, *enc.encode_ordinary("user"), *nl, *enc.encode_ordinary(question), end, *nl,
                 start, *enc.encode_ordinary("assistant"), *nl])
    assert expected.count(end) == 2
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen_as_qwen2, dtype=torch.float32).eval()
    ref = hf_greedy(hf, expected, 8)
    with _engine(tiny_qwen) as engine:
        assert engine.encode(question, chat=True) == expected
        [result] = engine.generate([question], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                   chat=True)
    assert result.prompt_token_ids == expected
    assert_greedy_matches(result.token_ids, ref, allow_near_tie=True)


def test_chat_stop_set_ends_generation(tiny_qwen, tiny_qwen_as_qwen2) -> None:
    """<|im_end|>, <|im_start|> and <|endoftext|> each end an answer (generation_config.json
    names only <|endoftext|>): prompts whose greedy next token is one of them, found with the
    reference model, stop right there."""
    tokenizer = load_tokenizer(tiny_qwen)
    stops = [tokenizer.special_ids[n] for n in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen_as_qwen2, dtype=torch.float32).eval()
    candidates = torch.randint(0, TINY_QWEN["vocab_size"], (20000, 3),
                               generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        next_ids = hf(candidates).logits[:, -1].argmax(-1)
    found = {}
    for prompt, next_id in zip(candidates.tolist(), next_ids.tolist(), strict=True):
        found.setdefault(next_id, prompt)
    prompts = [found[s] for s in stops if s in found]
    assert len(prompts) >= 2, "too few prompts whose greedy next token is a stop id"
    with _engine(tiny_qwen) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    for result in results:
        assert result.finish_reason.value == "stop" and len(result.token_ids) == 1
        assert result.token_ids[0] in stops


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}])
def test_tp2_and_pp2_equal_tp1(parallel, tiny_qwen) -> None:
    with _engine(tiny_qwen) as engine:
        single = [r.token_ids for r in engine.generate(_prompts(5), GREEDY)]
    with _engine(tiny_qwen, **parallel) as engine:
        split = [r.token_ids for r in engine.generate(_prompts(5), GREEDY)]
    assert split == single


def _copy(tiny_qwen, tmp_path):
    folder = tmp_path / "q"
    shutil.copytree(tiny_qwen, folder)
    return folder


def test_missing_tiktoken_fails_naming_the_file(tiny_qwen, tmp_path) -> None:
    folder = _copy(tiny_qwen, tmp_path)
    (folder / "qwen.tiktoken").unlink()
    with pytest.raises(ModelLoadError, match="qwen.tiktoken: no such file") as info:
        load_tokenizer(folder)
    assert "\n" not in str(info.value)


def test_corrupt_tiktoken_fails_naming_the_file_and_line(tiny_qwen, tmp_path) -> None:
    folder = _copy(tiny_qwen, tmp_path)
    lines = (folder / "qwen.tiktoken").read_text().splitlines()
    lines[7] = "not*base64 seven"
    (folder / "qwen.tiktoken").write_text("\n".join(lines))
    with pytest.raises(ModelLoadError, match=r"qwen.tiktoken: line 8 is not `base64-token rank`") as info:
        load_tokenizer(folder)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field", ["kv_channels", "seq_length", "layer_norm_epsilon", "rotary_emb_base",
                                   "use_logn_attn"])
def test_config_lacking_a_field_fails_naming_file_and_field(field, tiny_qwen, tmp_path) -> None:
    folder = _copy(tiny_qwen, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    del raw[field]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=rf"config.json lacks the field '{field}'") as info:
        load_model_config(folder)
    assert "\n" not in str(info.value)


def test_structured_outputs_work_on_the_tiktoken_vocabulary(tiny_qwen) -> None:
    """The grammar's token table comes from qwen.tiktoken's bytes (no Hugging Face tokenizer)."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "legs": {"enum": [2, 4]}},
              "required": ["kind", "legs"], "additionalProperties": False}
    grammar = json.dumps({"type": "json_schema", "schema": schema})
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, grammar=grammar) for i in range(2)]
    with _engine(tiny_qwen) as engine:
        results = engine.generate(["Describe a pet.", "Another one."], params, chat=True)
    for result in results:
        assert result.finish_reason.value == "stop"
        answer = json.loads(result.text)
        assert answer["kind"] in ("cat", "dog") and answer["legs"] in (2, 4)


QUANTIZED = [{"quantization": "fp8"}, {"quantization": "int8"}, {"kv_cache_dtype": "fp8"}]


@pytest.mark.parametrize("flags", QUANTIZED, ids=["fp8-weights", "int8-weights", "fp8-kv"])
def test_quantized_runs_equal_the_qwen2_folders_under_the_same_flags(flags, tiny_qwen,
                                                                    tiny_qwen_as_qwen2) -> None:
    """The stacked c_attn, quantized as its q/k/v rows load, gives the very weights (and tokens) that
    the separate q/k/v tensors of the Qwen2 folder give."""
    prompts = _prompts(7)[:3]
    with _engine(tiny_qwen, **flags) as engine:
        ours = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    with _engine(tiny_qwen_as_qwen2, **flags) as engine:
        as_qwen2 = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    assert ours == as_qwen2
