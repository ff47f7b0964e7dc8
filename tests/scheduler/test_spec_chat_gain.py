"""The expected-gain rule on a real model (SmolLM2-135M-Instruct, float32, through the engine
with async scheduling): an open chat, whose answer repeats little of itself or its prompt, stops
speculating after its first look-ups; a request to copy a passage keeps speculating; greedy
output equals plain decoding's either way. Steps are priced as on the H100 run that set the
rule's constants (gain.py), so the decisions do not depend on this machine's timing."""

from __future__ import annotations

import pytest

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.speculative import SpeculativeConfig
from testkit.spec_runs import CHAT_PROMPTS, COPY_PROMPTS, SpecSteps

NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=72)


def _engine(model, spec: SpeculativeConfig | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=16, num_kv_blocks=128,
                                  max_num_seqs=4, max_num_batched_tokens=512, async_scheduling=True,
                                  speculative_config=spec))


@pytest.mark.slow
def test_an_open_chat_stops_speculating_a_copy_keeps_it_and_greedy_output_is_plain(smollm2) -> None:
    with _engine(smollm2, None) as engine:
        prompts = {"copy": engine.encode(COPY_PROMPTS[1], chat=True),
                   "chat": engine.encode(CHAT_PROMPTS[1], chat=True)}
        plain = {name: engine.generate([p], GREEDY)[0].token_ids for name, p in prompts.items()}
    runs = {}
    with _engine(smollm2, NGRAM) as engine:
        speculator = engine.scheduler.speculator
        assert speculator.gives_up_async
        speculator.step_cost = None  # the H100 run's proportions, not this machine's timing
        for name, prompt in prompts.items():
            steps, backoffs = SpecSteps(engine), speculator.num_backoffs
            tokens = engine.generate([prompt], GREEDY)[0].token_ids
            runs[name] = (tokens, steps.lookup_share, speculator.num_backoffs - backoffs, steps.ahead_share)
            steps.detach(engine)
    assert runs["copy"][0] == plain["copy"] and runs["chat"][0] == plain["chat"]
    copy_share, copy_backoffs, copy_ahead = runs["copy"][1:]
    chat_share, chat_backoffs, chat_ahead = runs["chat"][1:]
    # look-ups per step: every step of the copy looked for drafts; the chat's first few only,
    # and its other steps were planned while the one before ran (async scheduling)
    assert copy_backoffs == 0 and copy_share > 0.9 and copy_ahead < 0.2, runs["copy"][1:]
    assert chat_backoffs >= 1 and chat_share < 0.3 and chat_ahead > 0.7, runs["chat"][1:]
