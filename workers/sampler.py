"""Turns each sampled sequence's last-position logits into its next token.

Order, as in vLLM and HF: penalties on the raw logits; logprobs from those penalized
logits (vLLM's default "raw processed" logprobs); then temperature, top-k, top-p, min-p
and a draw from the softmax. Greedy rows take the argmax of the penalized logits.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from shared.sampling import SamplingParams
from shared.step import SampledToken, SequenceWork
from workers.device_sample import DeviceSample

# Temperatures below this are treated as greedy: dividing by them can overflow float32
# logits to inf and the softmax to NaN. vLLM uses the same cut.
_SAMPLING_EPS = 1e-5
_MASK_64 = (1 << 64) - 1


class Sampler:
    """Samples one token per row; owns the random stream of rows that have no seed."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        # device -> generator for unseeded rows; made lazily, as the device is known
        # only when logits arrive.
        self._generators: dict[torch.device, torch.Generator] = {}
        # device -> generator re-seeded for every seeded row, so it holds no history.
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, works: list[SequenceWork]) -> list[SampledToken]:
        """One token per row of `logits`; row i belongs to works[i]. Waits for the device."""
        return self.sample_on_device(logits, works).to_host().tokens()

    def sample_on_device(self, logits: torch.Tensor, works: list[SequenceWork],
                         pending_ids: torch.Tensor | None = None) -> DeviceSample:
        """The same picks, left on the device: nothing here waits for the device. `pending_ids`
        ([num_rows] long on the device, -1: none): under async scheduling, each penalized row's
        last output token, which its history (SequenceWork.output_token_ids) lacks."""
        # logits: [num_seqs, vocab]
        if logits.dim() != 2 or logits.shape[0] != len(works):
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} do not match {len(works)} works"
            )
        if all(_is_plain_greedy(w.sampling) for w in works):
            # The argmax of the logits as they come (bf16 -> float32 is exact and keeps the
            # order, ties included): no float32 copy of [num_seqs, vocab] (~0.1 ms at 256 rows).
            return DeviceSample(works, logits.argmax(dim=-1))
        logits = apply_penalties(logits.float(), works, pending_ids)
        token_ids = self._pick_tokens(logits, works)  # [num_seqs]
        return _with_logprobs(logits, token_ids, works)

    def _pick_tokens(self, logits: torch.Tensor, works: list[SequenceWork]) -> torch.Tensor:
        # logits: [num_seqs, vocab], penalized -> token ids: [num_seqs]
        random_rows = [i for i, w in enumerate(works) if w.sampling.temperature >= _SAMPLING_EPS]
        if not random_rows:
            return logits.argmax(dim=-1)
        random_works = [works[i] for i in random_rows]
        if len(random_rows) == len(works):
            probs = processed_probs(logits, [w.sampling for w in random_works])
            return self._draw(probs, random_works)
        row_index = torch.tensor(random_rows, device=logits.device)
        probs = processed_probs(logits[row_index], [w.sampling for w in random_works])
        token_ids = logits.argmax(dim=-1)
        token_ids[row_index] = self._draw(probs, random_works)
        return token_ids

    def _draw(self, probs: torch.Tensor, works: list[SequenceWork]) -> torch.Tensor:
        """Exponential race: argmax(probs / E), E ~ Exp(1), draws from probs / sum(probs)."""
        # probs: [num_rows, vocab], rows need not sum to 1 -> token ids: [num_rows]
        device, vocab = probs.device, probs.shape[-1]
        noise = torch.empty_like(probs)
        seeded_rows = [i for i, w in enumerate(works) if w.sampling.seed is not None]
        if len(seeded_rows) < len(works):
            noise.exponential_(generator=self._generator(device))
        if seeded_rows:
            generator = self._seeded_generator(device)
            for i in seeded_rows:
                work = works[i]
                generator.manual_seed(_stream_seed(work.sampling.seed, work.num_output_tokens))
                # A fresh [vocab] draw, so the row's noise cannot depend on where it sits
                # in the batch or what else is in it.
                row_noise = torch.empty(vocab, device=device, dtype=probs.dtype)
                noise[i] = row_noise.exponential_(generator=generator)
        # A zero would turn a zero-prob token into 0/0 = NaN, which argmax picks.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def random_generator(self, device: torch.device) -> torch.Generator:
        """The random stream of unseeded rows (speculative verification draws from it too)."""
        return self._generator(device)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed & _MASK_64)
            self._generators[device] = generator
        return self._generators[device]

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._seeded_generators:
            self._seeded_generators[device] = torch.Generator(device=device)
        return self._seeded_generators[device]


def is_random(params: SamplingParams) -> bool:
    """Whether a row draws its token (else it takes the argmax)."""
    return params.temperature >= _SAMPLING_EPS


def _is_plain_greedy(params: SamplingParams) -> bool:
    return params.temperature < _SAMPLING_EPS and not params.has_penalties and params.logprobs is None


def apply_penalties(logits: torch.Tensor, works: list[SequenceWork],
                    pending_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition (HF/CTRL), then frequency and presence (OpenAI) penalties. A row's output
    counts are its history's plus its pending token's (`pending_ids[row]` when >= 0), counted
    on the device: the host never learnt that token.

    Returns `logits` itself when no row has penalties, else a penalized copy.
    """
    # logits: [num_seqs, vocab]
    rows = [i for i, w in enumerate(works) if w.sampling.has_penalties]
    if not rows:
        return logits
    params = [works[i].sampling for i in rows]
    device, vocab = logits.device, logits.shape[-1]
    row_index = torch.tensor(rows, device=device)
    penalized = logits[row_index]  # [num_penalized, vocab], a copy
    output_counts = _token_counts([works[i].output_token_ids for i in rows], vocab, device)
    if pending_ids is not None:
        pending = pending_ids[row_index]  # [num_penalized], -1: none
        output_counts.scatter_add_(1, pending.clamp(min=0).unsqueeze(1),
                                   (pending >= 0).to(output_counts.dtype).unsqueeze(1))

    if any(p.repetition_penalty != 1.0 for p in params):
        in_prompt = _token_mask([works[i].prompt_token_ids for i in rows], vocab, device)
        is_seen = in_prompt | (output_counts > 0)
        repetition = _column([p.repetition_penalty for p in params], device)
        # Dividing a positive logit and multiplying a negative one both lower the token.
        scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
        penalized = torch.where(is_seen, scaled, penalized)

    frequency = _column([p.frequency_penalty for p in params], device)
    presence = _column([p.presence_penalty for p in params], device)
    penalized = penalized - frequency * output_counts - presence * (output_counts > 0)

    logits = logits.clone()
    logits[row_index] = penalized
    return logits


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p; returns unnormalized probabilities."""
    # logits: [num_rows, vocab] -> probs: [num_rows, vocab]
    device = logits.device
    logits = logits / _column([p.temperature for p in params], device)  # a new tensor
    if any(p.top_k is not None or p.top_p < 1.0 for p in params):
        logits = _apply_top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], device)
        max_probs = probs.amax(dim=-1, keepdim=True)
        # No renormalizing: the exponential race samples proportionally to unnormalized
        # weights, and min-p is a ratio to the max, which no rescaling changes.
        probs = probs.masked_fill(probs < min_p * max_probs, 0.0)
    return probs


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k, then outside its nucleus."""
    # logits: [num_rows, vocab]
    device, vocab = logits.device, logits.shape[-1]
    # Stable, so tied logits keep ascending id order and top_k=1 agrees with argmax.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    if any(p.top_k is not None for p in params):
        top_k = _column([min(p.top_k or vocab, vocab) for p in params], device, torch.long)
        positions = torch.arange(vocab, device=device)  # [vocab]
        sorted_logits.masked_fill_(positions >= top_k, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # inf disables the cut for top_p == 1 rows, where float error in the cumsum
        # could otherwise reach 1.0 and drop the tail.
        top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass strictly above it is still short of top_p; the
        # best token has none above it, so at least one token always survives.
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits.masked_fill_(mass_above >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, works: list[SequenceWork]) -> DeviceSample:
    # logits: [num_seqs, vocab], penalized; token_ids: [num_seqs]
    num_logprobs = [w.sampling.logprobs for w in works]
    if all(n is None for n in num_logprobs):
        return DeviceSample(works, token_ids)
    logprobs = logits.log_softmax(dim=-1)  # [num_seqs, vocab]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    num_top = min(max(n or 0 for n in num_logprobs), logits.shape[-1])
    if num_top == 0:
        return DeviceSample(works, token_ids, chosen)
    values, indices = logprobs.topk(num_top, dim=-1)  # [num_seqs, num_top], best first
    return DeviceSample(works, token_ids, chosen, values, indices)


def _token_counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each list: [len(id_lists), vocab] float32."""
    counts = torch.zeros(len(id_lists), vocab, device=device)
    rows, ids = _flat_ids(id_lists, vocab, device)
    return counts.index_put_((rows, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)


def _token_mask(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Whether each token id occurs in each list: [len(id_lists), vocab] bool."""
    mask = torch.zeros(len(id_lists), vocab, dtype=torch.bool, device=device)
    rows, ids = _flat_ids(id_lists, vocab, device)
    return mask.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.bool))


def _flat_ids(
    id_lists: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) of every entry, flattened: two [total_len] int64 tensors."""
    # numpy, because torch.tensor on long Python lists costs ~10x more per element and
    # histories run to thousands of tokens per row.
    lengths = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    ids = np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        # Caught here: on CUDA the indexing would die on a device-side assert.
        raise ValueError(f"token id outside the logits' vocab of {vocab}")
    rows = np.repeat(np.arange(len(id_lists), dtype=np.int64), lengths)
    return torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device)


def _column(
    values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Per-row parameters as a [num_rows, 1] tensor, to broadcast over the vocab."""
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _stream_seed(seed: int, num_output_tokens: int) -> int:
    """A 64-bit generator seed that depends only on (seed, num_output_tokens)."""
    return _splitmix64((_splitmix64(seed & _MASK_64) + num_output_tokens) & _MASK_64)


def _splitmix64(x: int) -> int:
    # Finalizer of splitmix64: nearby inputs (seed, seed + 1) give unrelated outputs.
    x = (x + 0x9E3779B97F4A7C15) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)
