"""Grammar-constrained decoding in the engine: a random-weight model (which left alone writes
noise) answers schema-valid JSON under the mask; unconstrained rows in the same batch are not
touched; the grammar's state survives preemption and a takeover from stored tokens."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from scheduler.engine import LLMEngine
from scheduler.grammar import Grammars
from shared.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from shared.step import SequenceWork


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    is_friendly: bool
    legs: Literal[0, 2, 4]


PET_GRAMMAR = json.dumps({"type": "json_schema", "schema": Pet.model_json_schema()})
PROMPTS = ["Describe a pet.", "Name an animal.", "What lives in water?", "Tell me about dogs."]


def _engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def _params(i: int, grammar: str | None, **overrides) -> SamplingParams:
    fields = {"max_tokens": 40, "temperature": 1.0, "seed": i, "grammar": grammar}
    return SamplingParams(**{**fields, **overrides})


@pytest.mark.slow
def test_random_weights_answer_schema_valid_json_and_free_rows_are_untouched(tiny_chat):
    with _engine(tiny_chat) as engine:
        free_alone = engine.generate(PROMPTS, [_params(i, None, max_tokens=12) for i in range(4)], chat=True)
        mixed = engine.generate(PROMPTS * 2, [_params(i, PET_GRAMMAR) for i in range(4)]
                                + [_params(i, None, max_tokens=12) for i in range(4)], chat=True)
    constrained, free = mixed[:4], mixed[4:]
    for result in constrained:
        assert result.finish_reason.value == "stop"  # the grammar ended it (EOS after the JSON)
        Pet.model_validate_json(result.text)
    # The same seeded unconstrained requests draw the same tokens with or without grammar rows beside them.
    assert [r.token_ids for r in free] == [r.token_ids for r in free_alone]
    # Without the grammar, the random model writes no JSON.
    assert not any(r.text.startswith('{"kind"') for r in free_alone)


@pytest.mark.slow
@pytest.mark.parametrize("jump_forward", [False, True], ids=["masked", "jump_forward"])
def test_the_grammar_survives_preemption(tiny_chat, jump_forward):
    # Four blocks of 16 tokens for two ~40-token prompts growing to ~60 tokens: they preempt each other.
    greedy = [_params(i, PET_GRAMMAR, temperature=0.0) for i in range(2)]
    with _engine(tiny_chat, grammar_jump_forward=jump_forward) as roomy:
        expected = roomy.generate(PROMPTS[:2], greedy, chat=True)
    with _engine(tiny_chat, num_kv_blocks=6, grammar_jump_forward=jump_forward) as tight:
        ids = [tight.add_request(tight.encode(p, chat=True), sp)
               for p, sp in zip(PROMPTS[:2], greedy, strict=True)]
        requests = [tight.scheduler.get_request(i) for i in ids]
        outputs = {i: [] for i in ids}
        while tight.has_unfinished_requests():
            for out in tight.step():
                outputs[out.req_id] += out.new_token_ids
        assert sum(r.num_preemptions for r in requests) > 0
    assert [outputs[i] for i in ids] == [r.token_ids for r in expected]
    for result in expected:
        Pet.model_validate_json(result.text)


@pytest.mark.slow
def test_a_takeover_rebuilds_the_grammar_from_the_stored_tokens(tiny_chat):
    sampling = _params(7, PET_GRAMMAR, temperature=0.0)
    with _engine(tiny_chat) as first:
        prompt = first.encode(PROMPTS[0], chat=True)
        (whole,) = first.generate([prompt], sampling)
    assert len(whole.token_ids) > 6
    with _engine(tiny_chat) as successor:
        stored = whole.token_ids[:5]  # what the dead scheduler had written to tf:res
        req_id = successor.add_request(prompt, sampling, output_token_ids=stored)
        rest = []
        while successor.has_unfinished_requests():
            for out in successor.step():
                rest += out.new_token_ids
        assert stored + rest == whole.token_ids
        # Stored tokens the grammar cannot have produced: refused, naming the grammar's field.
        with pytest.raises(InvalidRequestError) as refused:
            successor.add_request(prompt, sampling, output_token_ids=successor.encode("hello"))
        assert refused.value.param == "response_format"
        assert req_id not in successor.scheduler.grammars


def test_only_the_sampled_constrained_rows_get_a_mask(smollm2):
    from gateway.models import _load_tokenizer

    grammars = Grammars(_load_tokenizer(str(smollm2)), 49152, [2])
    grammars.add("json", json.dumps({"type": "json_object"}), [])
    grammars.add("free", None, [])
    sampling = SamplingParams()
    works = [SequenceWork("json-prefill", [1, 2], 0, [0], False, sampling),  # a chunk that samples nothing
             SequenceWork("free", [3], 5, [1], True, sampling),
             SequenceWork("json", [4], 5, [2], True, sampling)]
    mask = grammars.fill(works)
    assert mask.rows == [1]  # the second sampled row
    assert tuple(mask.bits.shape) == (1, 49152 // 32)
    allowed = [t for t in range(49152) if mask.bits[0, t // 32] >> (t % 32) & 1]
    assert 0 < len(allowed) < 49152 and 2 not in allowed  # "{"-like tokens; not EOS before any JSON
    assert grammars.fill(works[:2]) is None  # no constrained row: no mask at all
    with pytest.raises(InvalidRequestError) as bad:
        grammars.add("bad", json.dumps({"type": "json_schema", "schema": {"type": "strin"}}), [])
    assert bad.value.param == "response_format" and "strin" in bad.value.message


@pytest.mark.slow
@pytest.mark.parametrize("group", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_in_a_ray_group_the_mask_reaches_the_rank_that_samples(tiny_chat, group):
    # pp=2: two steps in flight, each with its own requests, each mask filled before it is sent.
    greedy = [_params(i, PET_GRAMMAR, temperature=0.0) for i in range(4)]
    with _engine(tiny_chat) as one_rank:
        expected = one_rank.generate(PROMPTS, greedy, chat=True)
    with _engine(tiny_chat, **group) as ranks:  # a Ray group: the batch, mask included, is pickled
        results = ranks.generate(PROMPTS, greedy, chat=True)
        if "pp" in group:
            assert ranks.executor.peak_in_flight == 2
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    for result in results:
        Pet.model_validate_json(result.text)


def test_logits_wider_than_the_tokenizer_never_allow_the_padding_ids(smollm2):
    from gateway.models import _load_tokenizer

    padded = 49152 + 64  # models round their vocabulary up; those ids are no tokenizer's tokens
    grammars = Grammars(_load_tokenizer(str(smollm2)), padded, [2])
    grammars.add("any", json.dumps({"type": "json_object"}), [])
    grammars.accept("any", _load_tokenizer(str(smollm2)).encode('{"a": "', add_special_tokens=False)[0])
    mask = grammars.fill([SequenceWork("any", [1], 3, [0], True, SamplingParams())])
    assert tuple(mask.bits.shape) == (1, padded // 32)
    inside_a_string = [t for t in range(padded) if mask.bits[0, t // 32] >> (t % 32) & 1]
    assert len(inside_a_string) > 1000 and max(inside_a_string) < 49152


def test_json_object_and_schema_grammars_allow_compact_json_only(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    grammars = Grammars(tokenizer, 49152, [2])
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    for grammar in (json.dumps({"type": "json_object"}), PET_GRAMMAR):
        grammars.add("compact", grammar, encode('{"kind": "cat", "is_friendly": true, "legs": 4}'))
        for spaced in ['{\n  "kind": "cat"', '{"kind":"cat"', '{ "kind": "cat"']:
            with pytest.raises(InvalidRequestError):
                grammars.add("spaced", grammar, encode(spaced))


def test_a_json_schema_without_strict_false_allows_only_the_properties_it_names(smollm2):
    """As vLLM (xgrammar's strict mode): a schema of name and age gets exactly those keys unless
    the request says `strict: false`, which reads the schema as JSON Schema does (other keys
    allowed where it does not forbid them). The gateway writes the spec the scheduler compiles."""
    from transformers import AutoTokenizer

    from gateway.openai.schemas import ResponseFormat
    from gateway.openai.structured import response_format_grammar

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2))
    grammars = Grammars(tokenizer, 49152, [2])
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    named, extra = encode('{"name": "Al", "age": 3}'), encode('{"name": "Al", "age": 3, "job": "cook"}')
    for strict in (None, True, False):
        spec = {"name": "person", "schema": schema} | ({} if strict is None else {"strict": strict})
        grammar = response_format_grammar(ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": spec}))
        grammars.add(f"named-{strict}", grammar, named)
        if strict is False:
            grammars.add("extra-False", grammar, extra)
        else:
            with pytest.raises(InvalidRequestError):
                grammars.add(f"extra-{strict}", grammar, extra)


def test_the_first_constrained_request_finds_the_compiler_and_json_grammar_built_at_start_up(
        smollm2, monkeypatch):
    # What the first constrained request would wait on: the tokenizer's tables and the compiler
    # (built once per engine), and the compile of its grammar. After prepare_grammars (start-up:
    # the service's run, warm_up) none of them is built for it: json_object is a cache hit.
    import xgrammar as xgr

    with _engine(smollm2) as engine:
        engine.prepare_grammars()
        built: list[str] = []
        for name in ("TokenizerInfo", "GrammarCompiler"):
            cls = getattr(xgr, name)
            monkeypatch.setattr(xgr, name,
                                lambda *a, _cls=cls, _name=name, **k: built.append(_name) or _cls(*a, **k))
        compiler = engine.scheduler.grammars._compiler
        cache_before = compiler.get_cache_size_bytes()
        json_object = json.dumps({"type": "json_object"})
        [result] = engine.generate(["Paris as a JSON object:"], _params(0, json_object, max_tokens=8))
        assert built == []
        assert compiler.get_cache_size_bytes() == cache_before  # its grammar was compiled already
        assert result.text.startswith("{")


def test_without_start_up_the_first_constrained_request_builds_the_compiler(smollm2):
    # The same engine not prepared: the compiler is what its first constrained request builds (so
    # the test above pins something that start-up moved).
    with _engine(smollm2) as engine:
        assert not engine.scheduler.grammars.is_prepared
        json_object = json.dumps({"type": "json_object"})
        engine.generate(["Paris as a JSON object:"], _params(0, json_object, max_tokens=4))
        assert engine.scheduler.grammars.is_prepared
