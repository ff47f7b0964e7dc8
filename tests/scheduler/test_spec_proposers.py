"""The speculative config's parsing and the n-gram proposer (scheduler/speculative/)."""

from __future__ import annotations

import pytest

from scheduler.request import Request
from scheduler.speculative.proposers import NgramProposer
from scheduler.speculative.speculator import Speculator, can_speculate
from shared.sampling import SamplingParams
from shared.speculative import SpeculativeConfig, SpeculativeConfigError, parse_speculative_config


def test_config_parses_vllm_spelling_and_round_trips_through_str():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2}')
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (5, 3, 2)
    assert parse_speculative_config(str(config)) == config


@pytest.mark.parametrize(("text", "names"), [
    ('{"method": "eagle9"}', "eagle9"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "not built"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
    ('{"method": "draft_model", "model": "d", "prompt_lookup_max": 3}', "prompt_lookup_max"),
    ('{"method": "ngram", "model": "d"}', '"model"'),
    ('{"model": "d", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
    ('{"method": "ngram", "lookahead": 3}', "lookahead"),
    ('{"num_speculative_tokens": 3}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}', "prompt_lookup_min"),
    ('{"method": "ngram", "min_acceptance_rate": 2}', "min_acceptance_rate"),
    ('{"method": "ngram", "min_speedup": -1}', "min_speedup"),
    ("ngram", "not JSON"),
])
def test_config_refuses_what_it_cannot_run_naming_it(text, names):
    with pytest.raises(SpeculativeConfigError, match=names):
        parse_speculative_config(text)


def test_a_model_without_a_method_is_a_draft_model_as_in_vllm():
    config = parse_speculative_config('{"model": "/models/draft", "num_speculative_tokens": 3}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/models/draft", 3)
    assert parse_speculative_config(str(config)) == config
    explicit = parse_speculative_config({"method": "draft_model", "model": "/models/draft",
                                         "num_speculative_tokens": 3})
    assert explicit == config


def test_one_lookup_bound_alone_keeps_min_below_max():
    assert parse_speculative_config('{"method": "ngram", "prompt_lookup_max": 1}').prompt_lookup_min == 1
    assert parse_speculative_config('{"method": "ngram", "prompt_lookup_min": 6}').prompt_lookup_max == 6


def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    proposer = NgramProposer(min_n=2, max_n=4)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 0, 2, 3]
    # suffix [2, 3] matches at 1..2 (then 9) and 5..6 (then 7): the most recent wins
    assert proposer.propose(tokens, 3) == [7, 8, 0]
    # a longer match wins over a more recent shorter one: [1, 2, 3] is at 0..2 and 4..6
    assert proposer.propose([5, 1, 2, 3, 4, 6, 2, 3, 8, 1, 2, 3], 2) == [4, 6]
    assert proposer.propose([5, 6, 7, 8], 3) == []  # no earlier occurrence
    assert proposer.propose([1, 2, 4, 2], 3) == []  # only a 1-gram matches, below min_n
    assert proposer.propose(tokens, 0) == []


def test_ngram_proposal_stops_at_the_known_tokens():
    assert NgramProposer(2, 2).propose([4, 5, 4, 5], 8) == [4, 5]  # [4, 5] at 0..1, then 4, 5


def _request(req_id: str = "r", **sampling) -> Request:
    return Request(req_id, [1, 2, 3, 1, 2], SamplingParams(temperature=0.0, **sampling))


@pytest.mark.parametrize("sampling", [{"logprobs": 0}, {"prompt_logprobs": 0}, {"seed": 1},
                                      {"presence_penalty": 0.5}, {"grammar": '{"type": "json_object"}'}])
def test_requests_whose_sampling_verification_cannot_keep_exact_do_not_speculate(sampling):
    assert can_speculate(_request())
    assert not can_speculate(_request(**sampling))
    assert Speculator(SpeculativeConfig()).propose(_request(**sampling), 4) == []


def test_request_backs_off_after_low_acceptance():
    config = SpeculativeConfig(num_speculative_tokens=4, min_acceptance_rate=0.5, min_speedup=0)
    speculator = Speculator(config)
    request = _request()
    assert speculator.propose(request, 4) == [3, 1, 2]
    for _ in range(8):  # every draft rejected
        speculator.record(request, 4, 0)
    assert not speculator.wants_to_speculate(request) and speculator.propose(request, 4) == []
    assert speculator.num_backoffs == 1
    # (how it comes back: tests/scheduler/test_spec_gain.py)


def test_request_with_good_acceptance_keeps_speculating():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    request = _request()
    for _ in range(20):
        speculator.record(request, 4, 3)
    assert speculator.wants_to_speculate(request)
    assert speculator.acceptance_rate == 0.75 and speculator.mean_accepted_length == 4.0
    assert speculator.num_accepted_tokens_per_pos == [20, 20, 20, 0]


def test_step_backs_off_above_the_batch_size():
    speculator = Speculator(SpeculativeConfig(disable_by_batch_size=4))
    assert speculator.step_allows(4) and not speculator.step_allows(5)
