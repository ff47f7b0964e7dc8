"""Sampler semantics: greedy, temperature, top-k/p, min-p, seeds, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from shared.sampling import SamplingParams
from shared.step import SequenceWork
from workers.sampler import Sampler, apply_penalties


def make_work(req_id: str = "r", num_output_tokens: int = 0, **sampling: object) -> SequenceWork:
    return SequenceWork(
        req_id=req_id,
        token_ids=[0],
        start_pos=0,
        block_ids=[0],
        is_sampled=True,
        sampling=SamplingParams(**sampling).validate(),
        num_output_tokens=num_output_tokens,
    )


def draw_many(logits_row: torch.Tensor, num_draws: int, **sampling: object) -> torch.Tensor:
    """Token ids of num_draws unseeded draws from one row, in one batch."""
    logits = logits_row.expand(num_draws, -1).contiguous()  # [num_draws, vocab]
    works = [make_work(f"r{i}", **sampling) for i in range(num_draws)]
    return torch.tensor([t.token_id for t in Sampler(seed=1).sample(logits, works)])


def assert_matches_distribution(token_ids: torch.Tensor, probs: torch.Tensor) -> None:
    """Pearson chi-square against expected counts; the bound is chi2's 0.9999 quantile."""
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()
    expected = probs.double() * token_ids.numel()
    assert counts[expected == 0].sum() == 0, "drew a token of probability zero"
    kept = expected > 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    dof = int(kept.sum()) - 1
    # Wilson-Hilferty approximation of the 0.9999 quantile (z = 3.72).
    bound = dof * (1 - 2 / (9 * dof) + 3.72 * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < bound, f"chi2 {chi2:.1f} over {bound:.1f} with {dof} dof"


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log() + 3.0  # a shift the softmax ignores


def test_greedy_picks_argmax_and_lowest_id_on_ties() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[5, 7] = logits[5, 30] = 100.0  # a tie: argmax's lowest id wins
    works = [make_work(f"r{i}", temperature=0.0) for i in range(6)]
    sampled = Sampler().sample(logits, works)
    assert [t.token_id for t in sampled] == logits.argmax(dim=-1).tolist()
    assert sampled[5].token_id == 7
    assert [t.req_id for t in sampled] == [w.req_id for w in works]


def test_plain_greedy_on_bf16_logits_picks_what_float32_logits_pick() -> None:
    """Plain greedy rows take the argmax of the logits' own dtype; rows with penalties or
    logprobs still go through float32. Both give the float32 argmax, ties included."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    logits[3, 5] = logits[3, 200] = 50.0
    plain = [make_work(f"r{i}", temperature=0.0) for i in range(8)]
    expected = logits.float().argmax(dim=-1).tolist()
    assert [t.token_id for t in Sampler().sample(logits, plain)] == expected
    assert expected[3] == 5
    with_logprobs = plain[:7] + [make_work("r7", temperature=0.0, logprobs=0)]
    sampled = Sampler().sample(logits, with_logprobs)
    assert [t.token_id for t in sampled] == expected and sampled[7].logprob is not None


def test_temperature_near_zero_converges_to_greedy() -> None:
    logits = torch.tensor([1.0, 2.0, 1.9, -1.0])
    for temperature in (1e-2, 1e-6):  # the second is under the greedy cut-off
        assert set(draw_many(logits, 500, temperature=temperature).tolist()) == {1}


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(20, 100, generator=torch.Generator().manual_seed(1))
    logits[3, 10] = logits[3, 60] = 50.0
    works = [make_work(f"r{i}", top_k=1) for i in range(20)]
    sampled = Sampler().sample(logits, works)
    assert [t.token_id for t in sampled] == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_only_the_k_largest() -> None:
    tokens = draw_many(LOGITS, 4000, top_k=2)
    assert_matches_distribution(tokens, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)


def test_small_top_p_keeps_only_top_token() -> None:
    assert set(draw_many(LOGITS, 500, top_p=1e-6).tolist()) == {0}


def test_top_p_keeps_smallest_set_reaching_top_p() -> None:
    # 0.5 + 0.3 = 0.8 reaches 0.7, so token 2 goes; 0.85 needs token 2 as well.
    assert_matches_distribution(
        draw_many(LOGITS, 4000, top_p=0.7), torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8
    )
    assert_matches_distribution(
        draw_many(LOGITS, 4000, top_p=0.85), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    )


def test_min_p_drops_tokens_below_fraction_of_max_prob() -> None:
    # min_p * max = 0.2 * 0.5 = 0.1: token 3 (0.05) goes, token 2 (0.15) stays.
    tokens = draw_many(LOGITS, 4000, min_p=0.2)
    assert_matches_distribution(tokens, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_draws_at_temperature_one_match_softmax() -> None:
    logits = torch.randn(16, generator=torch.Generator().manual_seed(2))
    assert_matches_distribution(draw_many(logits, 20000), logits.softmax(dim=-1))


def test_draws_at_temperature_half_match_tempered_softmax() -> None:
    logits = torch.randn(16, generator=torch.Generator().manual_seed(3))
    tokens = draw_many(logits, 20000, temperature=0.5)
    assert_matches_distribution(tokens, (logits / 0.5).softmax(dim=-1))


def test_seeded_draws_across_seeds_match_softmax() -> None:
    logits = torch.randn(8, generator=torch.Generator().manual_seed(4))
    works = [make_work(f"r{i}", seed=i) for i in range(3000)]
    sampled = Sampler().sample(logits.expand(3000, -1).contiguous(), works)
    tokens = torch.tensor([t.token_id for t in sampled])
    assert_matches_distribution(tokens, logits.softmax(dim=-1))


def test_seeded_draws_identical_across_batch_compositions_and_positions() -> None:
    vocab = 1000
    logits = torch.zeros(vocab)  # uniform: a chance match is 1 in 1000 per step
    others = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))

    def seeded_draw(sampler: Sampler, num_output_tokens: int, position: int) -> int:
        works = [
            make_work("greedy", temperature=0.0),
            make_work("unseeded", top_k=50),
            make_work("other-seed", seed=7, top_p=0.9),
        ]
        works.insert(position, make_work("me", num_output_tokens, seed=1234))
        rows = list(others)
        rows.insert(position, logits)
        sampled = sampler.sample(torch.stack(rows), works)
        return sampled[position].token_id

    def alone(num_output_tokens: int) -> int:
        work = make_work("me", num_output_tokens, seed=1234)
        return Sampler(seed=99).sample(logits.unsqueeze(0), [work])[0].token_id

    expected = [alone(n) for n in range(10)]
    sampler = Sampler(seed=0)  # its own stream advances between calls; seeded rows ignore it
    for position in range(4):
        assert [seeded_draw(sampler, n, position) for n in range(10)] == expected


def test_seeded_draws_differ_for_different_num_output_tokens_and_seeds() -> None:
    logits = torch.zeros(1, 1000)
    sampler = Sampler()

    def draw(seed: int, num_output_tokens: int) -> int:
        return sampler.sample(logits, [make_work("r", num_output_tokens, seed=seed)])[0].token_id

    by_step = [draw(1234, n) for n in range(20)]
    assert len(set(by_step)) >= 15
    by_seed = [draw(s, 0) for s in range(20)]
    assert len(set(by_seed)) >= 15


def test_repetition_penalty_matches_transformers_processor() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 32, generator=gen) * 3  # both signs
    histories = [([1, 2, 2, 5], [5, 9, 1]), ([0, 31], [7, 7, 7, 3])]
    for penalty in (1.3, 0.7):
        works = [make_work(f"r{i}", repetition_penalty=penalty) for i in range(len(histories))]
        for work, (prompt, output) in zip(works, histories, strict=True):
            work.prompt_token_ids, work.output_token_ids = prompt, output
        ours = apply_penalties(logits, works)
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        for i, (prompt, output) in enumerate(histories):
            input_ids = torch.tensor([prompt + output])
            theirs = processor(input_ids, logits[i : i + 1].clone())
            torch.testing.assert_close(ours[i : i + 1], theirs)


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(7))
    work = make_work(frequency_penalty=0.5, presence_penalty=1.5)
    work.prompt_token_ids = [4, 4, 8]  # the prompt does not count for these two
    work.output_token_ids = [1, 3, 3, 3, 8]
    counts = torch.bincount(torch.tensor(work.output_token_ids), minlength=10).float()
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
    expected = logits[0] - counts * 0.5 - (counts > 0).float() * 1.5
    torch.testing.assert_close(apply_penalties(logits, [work])[0], expected)


def test_penalties_leave_input_and_unpenalized_rows_untouched() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(8))
    before = logits.clone()
    penalized = make_work("a", presence_penalty=1.0)
    penalized.output_token_ids = [2]
    out = apply_penalties(logits, [penalized, make_work("b")])
    torch.testing.assert_close(logits, before)
    torch.testing.assert_close(out[1], before[1])
    assert out[0, 2] == before[0, 2] - 1.0


def test_penalties_with_empty_history_change_nothing() -> None:
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(13))
    work = make_work(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0)
    torch.testing.assert_close(apply_penalties(logits, [work]), logits)


def test_history_token_outside_vocab_raises_value_error() -> None:
    work = make_work(presence_penalty=1.0)
    work.output_token_ids = [10]
    with pytest.raises(ValueError, match="vocab"):
        apply_penalties(torch.zeros(1, 10), [work])


def test_logprob_of_chosen_token_is_log_softmax_after_penalties_before_temperature() -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(9))
    works = [
        make_work("a", temperature=0.0, logprobs=0),
        make_work("b", temperature=0.5, top_k=5, logprobs=0),
        make_work("c", temperature=1.3, top_p=0.5, min_p=0.1, logprobs=3),
        make_work("d", temperature=0.7, repetition_penalty=1.5, frequency_penalty=0.4, logprobs=0),
    ]
    works[3].prompt_token_ids, works[3].output_token_ids = [0, 1], [int(logits[3].argmax())] * 2
    raw = apply_penalties(logits, works).log_softmax(dim=-1)
    for i, token in enumerate(Sampler().sample(logits, works)):
        assert token.logprob == pytest.approx(raw[i, token.token_id].item(), abs=1e-5)


def test_top_logprobs_are_sorted_best_first_and_correct() -> None:
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(10))
    works = [make_work("a", logprobs=5), make_work("b", temperature=0.0, logprobs=2)]
    expected = logits.log_softmax(dim=-1).sort(dim=-1, descending=True)
    for i, token in enumerate(Sampler().sample(logits, works)):
        n = works[i].sampling.logprobs
        assert token.top_logprobs is not None and len(token.top_logprobs) == n
        ids = [t for t, _ in token.top_logprobs]
        values = [v for _, v in token.top_logprobs]
        assert ids == expected.indices[i, :n].tolist()
        assert values == pytest.approx(expected.values[i, :n].tolist(), abs=1e-5)
        assert values == sorted(values, reverse=True)


def test_logprobs_none_gives_none_and_zero_gives_only_chosen() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(11))
    none, zero = Sampler().sample(logits, [make_work("a"), make_work("b", logprobs=0)])
    assert none.logprob is None and none.top_logprobs is None
    assert zero.logprob is not None and zero.top_logprobs is None


def test_empty_batch_and_shape_mismatch() -> None:
    assert Sampler().sample(torch.empty(0, 10), []) == []
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 10), [make_work()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_matches_cpu_for_greedy_and_logprobs_and_is_seed_stable() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(12))
    works = [
        make_work("a", temperature=0.0, logprobs=2, presence_penalty=0.5),
        make_work("b", seed=3, top_k=100, top_p=0.9, min_p=0.01, logprobs=0),
        make_work("c", temperature=0.8),
    ]
    works[0].output_token_ids = [int(logits[0].argmax())]
    cpu = Sampler().sample(logits, works)
    gpu = Sampler().sample(logits.cuda(), works)
    gpu_again = Sampler(seed=5).sample(logits[1:2].cuda(), works[1:2])
    assert gpu[0].token_id == cpu[0].token_id
    assert gpu[0].logprob == pytest.approx(cpu[0].logprob, abs=1e-5)
    assert gpu_again[0].token_id == gpu[1].token_id


def test_a_pending_token_counts_as_the_last_of_the_penalized_history() -> None:
    """Under async scheduling a penalized row's last token is still on the device (pending_ids):
    the penalties are those of the history with it appended; -1 rows and free rows are as before."""
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(21))
    params = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3)
    rows = [make_work("a", **params), make_work("b", **params), make_work("c")]
    for work in rows[:2]:
        work.prompt_token_ids, work.output_token_ids = [1, 2], [5, 5, 7]
    with_pending = apply_penalties(logits, rows, torch.tensor([9, -1, 4]))
    rows[0].output_token_ids = [5, 5, 7, 9]
    torch.testing.assert_close(with_pending, apply_penalties(logits, rows))
    rows[0].output_token_ids = [5, 5, 7]  # without the pending token: another result
    assert not torch.equal(with_pending[0], apply_penalties(logits, rows)[0])
