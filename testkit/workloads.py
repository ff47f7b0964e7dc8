"""Workloads as the benchmarks send them: per request, prompt token ids and an exact output
length (greedy, EOS ignored): ShareGPT-like lognormal lengths (the GPU benchmarks) or uniform
ones (the CPU benchmarks), and a few warm-up prompts."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from shared.sampling import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]  # token ids of each request's prompt
    max_tokens: list[int]  # output tokens of each request (EOS ignored: exactly this many)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def head(self, n: int) -> Workload:
        return Workload(self.prompts[:n], self.max_tokens[:n])

    def batches(self, size: int) -> list[range]:
        return [range(i, min(i + size, len(self.prompts))) for i in range(0, len(self.prompts), size)]


def lognormal_length(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    # A lognormal of mean m has mu = ln m - sigma^2 / 2.
    return min(high, max(low, round(rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma))))


def sharegpt_workload(num_requests: int, vocab_size: int, *, prompt_max: int = 1024, output_max: int = 512,
                      seed: int = 0) -> Workload:
    """ShareGPT-like lengths: per request a prompt of random ids (lognormal length, mean 200,
    sigma 0.9, 8..prompt_max), then its output length (mean 180, sigma 0.8, 8..output_max)."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        num_prompt = lognormal_length(rng, 200, 0.9, 8, prompt_max)
        prompts.append([rng.randrange(vocab_size) for _ in range(num_prompt)])
        max_tokens.append(lognormal_length(rng, 180, 0.8, 8, output_max))
    return Workload(prompts, max_tokens)


def uniform_workload(num_requests: int, vocab_size: int, *, prompt_lens: tuple[int, int],
                     output_lens: tuple[int, int], first_id: int = 3, seed: int = 0) -> Workload:
    """Per request: a prompt of uniform length of ids from [first_id, vocab) (clear of SmolLM2's
    special ids 0-2), then a uniform output length; bounds inclusive."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        num_prompt = rng.randint(*prompt_lens)
        prompts.append([rng.randrange(first_id, vocab_size) for _ in range(num_prompt)])
        max_tokens.append(rng.randint(*output_lens))
    return Workload(prompts, max_tokens)


def greedy(max_tokens: int) -> SamplingParams:
    """What every benchmark asks for: greedy, exactly max_tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


WARMUP_PROMPT_LENS = (8, 100, 600, 17)


def warmup_prompts(vocab_size: int, max_len: int | None = None) -> list[list[int]]:
    """A few prompts of different lengths (clipped to leave room for 16 tokens in max_len)."""
    rng = random.Random(2)
    lens = [n if max_len is None else min(n, max_len - 16) for n in WARMUP_PROMPT_LENS]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


