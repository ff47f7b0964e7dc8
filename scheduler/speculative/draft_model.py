"""The draft-model proposer: a smaller model, sharing the target's tokenizer, guesses K tokens.

The draft is a second ModelRunner in the engine's process (on the driver only: under tensor or
pipeline parallelism the target's ranks shard, the draft does not), with its own KV cache, handed
out here block by block (no prefix cache). Per request it remembers the tokens whose K/V its cache
holds (`_DraftSeq.token_ids`). To propose after `token_ids` (prompt + output):

1. catch up: the longest prefix the cache holds and `token_ids` share is kept; the rest of
   `token_ids` is computed (a prefill chunk after a new request or a resume, the last accepted
   drafts and the target's token after a verify). What follows the shared prefix in the cache
   (rejected drafts) is rolled back: its slots are overwritten, blocks past the need go back;
2. decode greedily: the catch-up's last row gives d1, then d1 .. d(K-1) go in one at a time,
   each giving the next draft. dK's own K/V is computed at the next catch-up if it is accepted.

Catching up by comparing tokens makes preemption, resume and rejected drafts one rule: the draft's
cache is right for whatever prefix matches, whatever happened to the request meanwhile.

Drafts are the draft's argmax, a deterministic function of the tokens: a sampled request's
verification treats them as a point-mass proposal (workers/spec_verify.py), which is exact for a
greedy draft; the draft's own probabilities would be the proposal only if drafts were sampled
from them.

When the draft's cache is full, the least recently proposed-for other requests lose their
draft KV (they catch up from scratch next time); a request that still does not fit gets no drafts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.config import EngineConfig
from shared.errors import ModelLoadError
from shared.logging import get_logger
from shared.model_config import ModelConfig, load_model_config
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch

GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass
class _DraftSeq:
    """What the draft's cache holds of one request."""

    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V is computed, in order
    block_ids: list[int] = field(default_factory=list)
    last_used: int = 0  # the propose() call that last used it


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def check_same_tokenizer(target_folder: str, target: ModelConfig, draft_folder: str,
                         draft: ModelConfig) -> None:
    """ModelLoadError naming both folders when their vocabularies differ: the config's vocab_size,
    and the tokenizer.json vocabularies where both folders hold one."""
    if draft.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"the draft model {draft_folder!r} has vocab_size {draft.vocab_size}, the target "
            f"{target_folder!r} {target.vocab_size}: a draft must share the target's tokenizer")
    vocabs = [_tokenizer_vocab(Path(folder)) for folder in (target_folder, draft_folder)]
    if None not in vocabs and vocabs[0] != vocabs[1]:
        raise ModelLoadError(
            f"the draft model {draft_folder!r} and the target {target_folder!r} have different "
            "tokenizers (tokenizer.json vocabularies differ): a draft must share the target's tokenizer")


def _tokenizer_vocab(folder: Path) -> tuple | None:
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    vocab = (data.get("model") or {}).get("vocab")
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    return (json.dumps(vocab, sort_keys=True), tuple(added))


class DraftModelProposer:
    def __init__(self, runner, max_chunk_tokens: int) -> None:
        """runner: the draft's ModelRunner (workers/model_runner.py), its blocks this proposer's."""
        self.runner = runner
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.max_chunk_tokens = max(1, max_chunk_tokens)  # a catch-up's tokens per forward, at most
        self._free_blocks = list(range(runner.num_kv_blocks - 1, -1, -1))  # popped from the end
        self._seqs: dict[str, _DraftSeq] = {}  # req_id -> what the draft's cache holds of it
        self._freed_req_ids: list[str] = []  # since the last draft step: their block-table rows go
        self._num_calls = 0
        self._num_steps = 0
        self.num_catch_up_tokens = 0  # tokens the draft computed to catch up (prompts included)

    def propose(self, token_ids: Sequence[int], max_drafts: int, req_id: str = "") -> list[int]:
        return self.propose_many([(req_id, token_ids, max_drafts)])[0]

    def propose_many(self, items: list[tuple[str, Sequence[int], int]]) -> list[list[int]]:
        """Drafts for several requests at once, (req_id, token_ids, max_drafts) each: one batched
        draft step per catch-up chunk, then one per draft position."""
        self._num_calls += 1
        drafts: list[list[int]] = [[] for _ in items]
        active: list[tuple[int, str, _DraftSeq, Sequence[int], int]] = []
        for i, (req_id, token_ids, max_drafts) in enumerate(items):
            num_tokens = len(token_ids)
            # The last draft's K/V is not computed: positions up to num_tokens + max_drafts - 2 are.
            max_drafts = min(max_drafts, self.max_model_len - num_tokens + 1)
            if max_drafts <= 0 or num_tokens == 0:
                continue
            seq = self._seqs.setdefault(req_id, _DraftSeq())
            seq.last_used = self._num_calls  # (this call's requests are not evicted for each other)
            kept = min(common_prefix_length(seq.token_ids, token_ids), num_tokens - 1)
            seq.token_ids = list(token_ids[:kept])
            if self._reserve(req_id, seq, num_tokens + max_drafts - 1):
                active.append((i, req_id, seq, token_ids, max_drafts))
            else:
                self.forget(req_id)
        self._catch_up(active, drafts)
        while True:
            works = [(i, req_id, seq, [drafts[i][-1]]) for i, req_id, seq, _, max_drafts in active
                     if len(drafts[i]) < max_drafts]
            if not works:
                return drafts
            for i, token in zip([w[0] for w in works], self._run(works, [True] * len(works)), strict=True):
                drafts[i].append(token)

    def _catch_up(self, active: list, drafts: list[list[int]]) -> None:
        """Compute each active request's tokens past what the cache holds, in steps of at most
        max_chunk_tokens tokens in all; each request's first draft (the row after its last token)."""
        pending = {i: len(seq.token_ids) for i, _, seq, _, _ in active}  # item -> next position
        while pending:
            budget = self.max_chunk_tokens
            works, is_sampled = [], []
            for i, req_id, seq, token_ids, _ in active:
                if i not in pending or budget <= 0:
                    continue
                start = pending[i]
                end = min(len(token_ids), start + budget)
                budget -= end - start
                works.append((i, req_id, seq, list(token_ids[start:end])))
                is_sampled.append(end == len(token_ids))
                self.num_catch_up_tokens += end - start
                if end == len(token_ids):
                    del pending[i]
                else:
                    pending[i] = end
            sampled = iter(self._run(works, is_sampled))
            for (i, *_), done in zip(works, is_sampled, strict=True):
                if done:
                    drafts[i].append(next(sampled))

    def _run(self, works: list[tuple[int, str, _DraftSeq, list[int]]], is_sampled: list[bool]) -> list[int]:
        """One draft step: each work's tokens computed after its cache's; the greedy next token of
        each sampled one, in order."""
        batch = StepBatch(self._num_steps, [
            SequenceWork(req_id, token_ids, len(seq.token_ids), seq.block_ids, sampled, GREEDY)
            for (_, req_id, seq, token_ids), sampled in zip(works, is_sampled, strict=True)],
            freed_req_ids=self._freed_req_ids)
        self._freed_req_ids = []
        self._num_steps += 1
        result = self.runner.execute(batch)
        for _, _, seq, token_ids in works:
            seq.token_ids += token_ids
        return [token.token_id for token in result.sampled]

    def _reserve(self, req_id: str, seq: _DraftSeq, num_slots: int) -> bool:
        """Exactly the blocks for num_slots slots: the tail given back, or more taken (the least
        recently used caches of requests outside this call evicted if need be). False: they do
        not fit."""
        need = -(-num_slots // self.block_size)
        while len(seq.block_ids) > need:
            self._free_blocks.append(seq.block_ids.pop())
        while len(seq.block_ids) + len(self._free_blocks) < need:
            others = [r for r, other in self._seqs.items() if other.last_used < self._num_calls]
            if not others:
                return False
            self.forget(min(others, key=lambda r: self._seqs[r].last_used))
        while len(seq.block_ids) < need:
            seq.block_ids.append(self._free_blocks.pop())
        return True

    def forget(self, req_id: str) -> None:
        seq = self._seqs.pop(req_id, None)
        if seq is not None:
            self._free_blocks += reversed(seq.block_ids)
            self._freed_req_ids.append(req_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def close(self) -> None:
        self._seqs.clear()
        self.runner.close()


def check_draft_model(config: EngineConfig, target: ModelConfig) -> ModelConfig:
    """The draft's model config; ModelLoadError naming the folder when it is missing or broken,
    and both folders when the draft does not share the target's tokenizer."""
    folder = config.speculative_config.model
    try:
        draft = load_model_config(folder)
    except ModelLoadError as exc:
        raise ModelLoadError(f"speculative draft model: {exc.message}") from None
    check_same_tokenizer(config.model, target, folder, draft)
    return draft


def build_draft_proposer(config: EngineConfig, target: ModelConfig, max_model_len: int) -> DraftModelProposer:
    """The draft model of config.speculative_config, checked against the target (ModelLoadError
    naming the folders: missing, unreadable, another tokenizer), on the target's device and dtype.
    Its KV cache: config.num_kv_blocks blocks when given, else sized as the target's is, from what
    is free once the target has its own (CUDA) or from kv_cache_bytes_cpu (CPU)."""
    from workers.model_runner import ModelRunner  # torch is imported only for a draft model
    from workers.parallel import SINGLE_DEVICE

    folder = config.speculative_config.model
    check_draft_model(config, target)
    draft_config = EngineConfig(
        model=folder, device=config.device, dtype=config.dtype, block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks, kv_cache_memory_fraction=config.kv_cache_memory_fraction,
        kv_cache_bytes_cpu=config.kv_cache_bytes_cpu, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
        async_scheduling=False, num_threads=config.num_threads, cuda_graphs=False, seed=config.seed)
    runner = ModelRunner(draft_config, SINGLE_DEVICE)
    log = get_logger("tokenfleet.engine")
    log.info("draft_model_loaded", model=folder, num_kv_blocks=runner.num_kv_blocks,
             max_model_len=runner.max_model_len)
    return DraftModelProposer(runner, config.max_num_batched_tokens)
