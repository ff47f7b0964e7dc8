"""Speculative decoding's acceptance rules (workers/spec_verify.py) on a tiny model's logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.sampling import SamplingParams
from shared.step import SampledToken, SequenceWork
from workers import spec_verify
from workers.host_staging import HostStaging
from workers.sampler import Sampler, processed_probs

CPU_UPLOAD = HostStaging(torch.device("cpu")).upload  # zero-copy on CPU, as a CPU runner's
NUM_TRIALS = 20_000
TOP_K = 8
# The chi-square statistic's 99.9th percentile at TOP_K - 1 = 7 degrees of freedom: a right rule
# exceeds it once in a thousand seeds; the Sampler's seed is fixed, so the test is deterministic.
CHI2_7_DOF_999 = 24.32


def _work(req_id: str, drafts: list[int], sampling: SamplingParams) -> SequenceWork:
    return SequenceWork(req_id, [5, *drafts], start_pos=10, block_ids=[0], is_sampled=True,
                        sampling=sampling, num_draft_tokens=len(drafts))


@pytest.fixture(scope="module")
def tiny_logits(tiny_checkpoints) -> torch.Tensor:
    """[vocab]: a tiny random llama's next-token logits after a short prompt."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([[7, 99, 3, 250, 41]])).logits[0, -1]


def _first_emitted(logits: torch.Tensor, draft: int, sampling: SamplingParams) -> torch.Tensor:
    """The first token each of NUM_TRIALS verify rows emits for one draft: the draft when
    accepted, else the replacement."""
    works = [_work(f"r{i}", [draft], sampling) for i in range(NUM_TRIALS)]
    verified = spec_verify.verify(logits.expand(NUM_TRIALS, -1), works, Sampler(seed=1), CPU_UPLOAD)
    return torch.where(verified.is_accepted, draft, verified.replacement_ids)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    support = torch.nonzero(probs > 0).squeeze(1)
    counts = torch.stack([(tokens == t).sum() for t in support]).double()
    assert int(counts.sum()) == len(tokens), "a token outside top-k was emitted"
    expected = probs[support].double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampling_keeps_the_target_distribution_and_a_broken_rule_fails(tiny_logits, monkeypatch):
    """With the draft the model's second choice (p(draft) well inside (0, 1)), the emitted token's
    distribution is the sampler's top-k distribution (chi-square within its 99.9th percentile);
    drawing the rejected rows from p itself instead of the residual p - q is far outside it."""
    sampling = SamplingParams(temperature=1.0, top_k=TOP_K)
    probs = processed_probs(tiny_logits.unsqueeze(0), [sampling])[0]
    probs = probs / probs.sum()
    draft = int(probs.argsort(descending=True)[1])
    assert 0.05 < float(probs[draft]) < 0.9, "the draft must be neither sure nor hopeless"
    tokens = _first_emitted(tiny_logits, draft, sampling)
    num_accepted = int((tokens == draft).sum())
    assert 0 < num_accepted < NUM_TRIALS
    assert _chi_square(tokens, probs) < CHI2_7_DOF_999

    monkeypatch.setattr(spec_verify, "residual_probs", lambda probs, drafts: probs)  # the broken rule
    assert _chi_square(_first_emitted(tiny_logits, draft, sampling), probs) > 10 * CHI2_7_DOF_999


def test_greedy_accepts_the_run_of_drafts_equal_to_the_argmax_then_the_argmax():
    vocab = 16
    logits = torch.zeros(5, vocab)
    for row, best in enumerate([3, 4, 9, 6, 2]):
        logits[row, best] = 1.0
    greedy = SamplingParams(temperature=0.0)
    works = [_work("a", [3, 4, 5], greedy), _work("b", [6, 2], greedy)]  # a: rows 0-2, b: rows 3-4
    verified = spec_verify.verify(logits, works, Sampler(), CPU_UPLOAD)
    tokens = [SampledToken("a", 11), SampledToken("b", 12)]  # what their last rows sampled
    spec_verify.apply(tokens, verified)
    assert (tokens[0].num_accepted_drafts, tokens[0].token_id) == (2, 9)  # 3, 4 kept; 9 replaces 5
    assert (tokens[1].num_accepted_drafts, tokens[1].token_id) == (2, 12)  # all kept; the bonus token


def test_draft_rows_are_the_rows_before_each_works_last_in_the_eager_order():
    greedy = SamplingParams(temperature=0.0)
    decode = SequenceWork("d", [1], start_pos=3, block_ids=[0], is_sampled=True, sampling=greedy)
    works = [_work("a", [3, 4], greedy), decode, _work("b", [6], greedy)]
    # eager order: the decode (row 0), then a (rows 1-3), then b (rows 4-5)
    assert spec_verify.draft_rows(works) == [1, 2, 4]
