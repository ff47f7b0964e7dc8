"""Jump-forward decoding (EngineConfig.grammar_jump_forward, off by default): text the grammar
forces is appended without a sampling step; answers stay valid; off, every step adds one token."""

from __future__ import annotations

import json

import pytest

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from tests.scheduler.test_grammar import PET_GRAMMAR, PROMPTS, Pet

# Long keys the grammar spells out whole once their first character is written.
RECORD_SCHEMA = {"type": "object", "properties": {
    "identification_number": {"type": "integer", "minimum": 0, "maximum": 99},
    "is_currently_available": {"type": "boolean"},
    "classification": {"enum": ["mammal_of_the_forest", "bird_of_the_sea"]}},
    "required": ["identification_number", "is_currently_available", "classification"],
    "additionalProperties": False}
RECORD_GRAMMAR = json.dumps({"type": "json_schema", "schema": RECORD_SCHEMA})


def _run(folder, jump_forward: bool, sampling: list[SamplingParams]) -> tuple[list, list[list], int]:
    """(text, finish reason, token ids) of each request, its outputs, and the steps run."""
    config = EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                          grammar_jump_forward=jump_forward)
    with LLMEngine(config) as engine:
        ids = [engine.add_request(engine.encode(p, chat=True), sp)
               for p, sp in zip(PROMPTS[:len(sampling)], sampling, strict=True)]
        outputs = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.req_id].append(out)
        results = [("".join(o.text_delta for o in outputs[i]), outputs[i][-1].finish_reason.value,
                    [t for o in outputs[i] for t in o.new_token_ids]) for i in ids]
        return results, [outputs[i] for i in ids], engine.num_steps


@pytest.mark.slow
def test_jump_forward_appends_forced_text_unsampled_and_answers_stay_valid(tiny_chat):
    greedy = [SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar)
              for grammar in (RECORD_GRAMMAR, PET_GRAMMAR)]
    plain, plain_outputs, plain_steps = _run(tiny_chat, False, greedy)
    jumped, jumped_outputs, jumped_steps = _run(tiny_chat, True, greedy)
    # Off (the default): one token per request per step, as plain masked decoding.
    assert all(len(out.new_token_ids) == 1 for outs in plain_outputs for out in outs)
    # On: the forced stretches (keys, '": ', enum values) arrive with the sampled token before them.
    assert max(len(out.new_token_ids) for outs in jumped_outputs for out in outs) > 3
    assert jumped_steps < plain_steps
    for (text, reason, _), model in zip(plain + jumped, [None, Pet] * 2, strict=True):
        assert reason == "stop"  # the grammar ended it
        if model is Pet:
            Pet.model_validate_json(text)
        else:
            record = json.loads(text)
            assert set(record) == set(RECORD_SCHEMA["properties"])
            assert record["classification"] in RECORD_SCHEMA["properties"]["classification"]["enum"]


@pytest.mark.slow
def test_jump_forward_keeps_max_tokens_and_leaves_logprob_requests_alone(tiny_chat):
    sampling = [SamplingParams(max_tokens=5, temperature=0.0, grammar=RECORD_GRAMMAR),
                SamplingParams(max_tokens=80, temperature=0.0, grammar=RECORD_GRAMMAR, logprobs=0)]
    (cut, with_logprobs), (_, logprob_outputs), _ = _run(tiny_chat, True, sampling)
    assert cut[1] == "length" and len(cut[2]) == 5  # forced tokens count, and stop at max_tokens
    assert cut[0] == '{"identification_number"'[:len(cut[0])]  # a prefix of a valid answer
    # A request with logprobs samples every token, so each has its logprob, but the end token
    # that stopped it (listed by no OpenAI response).
    assert with_logprobs[1] == "stop" and json.loads(with_logprobs[0])["classification"]
    *sampled, last = logprob_outputs
    assert all(len(out.new_token_ids) == len(out.logprobs) == 1 for out in sampled)
    assert last.finished and len(last.new_token_ids) == 1 and last.logprobs is None
