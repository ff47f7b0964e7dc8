"""Mixed-step CUDA graphs: which steps take them, the fixed-slot layout of their static buffers,
the slot-layout attention launch against a float64 reference (Triton's interpreter on CPU hosts),
and the static-buffer forward against the eager runner, step after step, with CUDA faked on CPU."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from tests.workers.triton_interpreter import run_interpreted
from workers.layers import triton_attention
from workers.mixed_graphs import MixedGraphs, token_buckets
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE

GREEDY = SamplingParams(temperature=0.0)


def _graphs(**kw) -> MixedGraphs:
    args = dict(block_size=4, max_model_len=64, scratch_block=9, max_tokens=256, num_decode_slots=6,
                hidden_size=8, device=torch.device("cpu"), num_prefill_slots=3)
    return MixedGraphs(None, torch.zeros(1), **{**args, **kw})


def _work(i: int, tokens: list[int], pos: int, blocks: list[int], sampled: bool = True) -> SequenceWork:
    return SequenceWork(f"r{i}", tokens, pos, blocks, sampled, GREEDY)


def test_token_buckets_pad_a_step_by_less_than_an_eighth_above_128_tokens() -> None:
    sizes = token_buckets(2048)
    assert sizes[:3] == [16, 32, 48] and sizes[-1] == 2048 and len(sizes) == 40
    assert sizes == sorted(set(sizes))
    graphs = _graphs(max_tokens=2048)
    for n in range(1, 2049):
        size = graphs.bucket(n)
        assert size >= n and not any(n <= s < size for s in sizes)
        assert n <= 128 or size - n < n / 8
    assert graphs.bucket(2049) is None
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96, 100] and token_buckets(16) == [16]


def test_only_mixed_steps_that_fit_a_bucket_and_the_slots_take_the_graphs() -> None:
    graphs = _graphs(max_tokens=64)
    decodes = [_work(i, [1], 3, [i]) for i in range(6)]
    chunk = _work(9, list(range(20)), 0, [1, 2, 3, 4, 5])
    assert graphs.can_run(decodes + [chunk])
    assert graphs.can_run([chunk])
    assert not graphs.can_run(decodes)  # decode-only: the decode graphs' job
    assert not graphs.can_run(decodes + [_work(7, [1], 3, [7]), chunk])  # more decodes than slots
    assert not graphs.can_run([chunk] * 4)  # more chunks than prefill slots
    assert not graphs.can_run([_work(9, list(range(65)), 0, list(range(17)))])  # above the largest bucket
    assert not graphs.can_run([_work(9, list(range(8)), 60, list(range(17)))])  # past max_model_len


def test_static_buffers_put_decodes_and_chunks_in_their_slots_and_padding_on_the_scratch_block() -> None:
    graphs = _graphs()
    works = [_work(0, [11, 12, 13], 4, [5, 6]),  # a chunk with a cached prefix of 4
             _work(1, [21], 7, [3, 8]),  # a decode at position 7
             _work(2, [31, 32], 0, [2], sampled=False)]  # a chunk that does not sample yet
    with torch.inference_mode():
        rows = graphs._load_inputs(works, 16)
    # Rows: the decode, then the chunks in batch order; padding to 16 after them.
    assert graphs.token_ids[:6].tolist() == [21, 11, 12, 13, 31, 32]
    assert graphs.positions[:6].tolist() == [7, 4, 5, 6, 0, 1]
    assert graphs.slot_mapping[:6].tolist() == [8 * 4 + 3, 6 * 4, 6 * 4 + 1, 6 * 4 + 2, 2 * 4, 2 * 4 + 1]
    assert set(graphs.slot_mapping[6:16].tolist()) == {9 * 4}
    # Slots: decode 0, five empty decode slots, then the two chunks, one empty prefill slot.
    assert graphs.query_start_loc.tolist() == [0, 1, 1, 1, 1, 1, 1, 4, 6, 6]
    assert graphs.seq_lens[0].item() == 8 and graphs.seq_lens[6:8].tolist() == [7, 2]
    assert graphs.block_tables[0, :2].tolist() == [3, 8]
    assert graphs.block_tables[6, :2].tolist() == [5, 6] and graphs.block_tables[7, 0].item() == 2
    assert graphs.block_tables[1, 0].item() == 9  # an empty slot points at the scratch block
    assert rows.tolist() == [3, 0]  # the chunk's last row, then the decode's; the third does not sample


def test_static_buffers_refuse_a_block_table_that_does_not_cover_the_step() -> None:
    with torch.inference_mode(), pytest.raises(ValueError, match="r0"):
        _graphs()._load_inputs([_work(0, [1, 2, 3], 6, [1, 2])], 16)


# -- the slot-layout attention launch ----------------------------------------------------

_SLOTS_CHECK = """
import torch
from tests.workers.test_triton_attention import make_step, reference
from workers.layers import triton_attention

# Decodes (cached 0, 16, 90) in 3 of 5 decode slots; chunks (37 new, 5 after 33 cached, 70
# after 20) in 3 of 4 prefill slots; the query rows padded from 115 to 128.
query_lens, cached = [1, 1, 1, 37, 5, 70], [0, 16, 90, 0, 33, 20]
step = make_step(query_lens, cached, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=16, page_size=4,
                 dtype=torch.float32, device="cpu", seed=SEED)
ref = reference(step, 16**-0.5)
decode_slots, prefill_slots, tokens = 5, 4, 128
slots = [0, 1, 2, 5, 6, 7]
num_slots = decode_slots + prefill_slots
tables = torch.full((num_slots, step["block_tables"].shape[1]), 0, dtype=torch.long)
tables[slots] = step["block_tables"]
seq_lens = torch.ones(num_slots, dtype=torch.long)
seq_lens[slots] = step["seq_lens"]
starts = step["query_start_loc"].tolist()
query_start = [0, 1, 2, 3, 3, 3, 3 + 37, 3 + 37 + 5, 115, 115]
q = torch.full((tokens, HEADS, 16), float("nan"))
q[:115] = step["q"]
out = triton_attention.paged_attention_slots(q, step["k_cache"], step["v_cache"], tables, seq_lens,
                                             torch.tensor(query_start), 16**-0.5,
                                             num_decode_slots=decode_slots)
error = float((out[:115].double() - ref).norm() / ref.norm())
assert error < 1e-5, error
print("ok")
"""


@pytest.mark.skipif(triton_attention.triton is None, reason="needs Triton installed")
@pytest.mark.parametrize(("heads", "kv_heads", "seed"), [(4, 2, 0), (6, 6, 1)])
def test_slot_layout_attention_matches_the_reference_in_the_interpreter(heads, kv_heads, seed) -> None:
    """Empty slots exit, padded query rows (NaN here) reach no real row, and every real row
    matches the float64 reference, in Triton's CPU interpreter."""
    code = _SLOTS_CHECK.replace("KV_HEADS", str(kv_heads)).replace("HEADS", str(heads))
    code = code.replace("SEED", str(seed))
    run_interpreted(code)


@pytest.mark.skipif(not torch.cuda.is_available() or triton_attention.triton is None,
                    reason="needs CUDA and Triton")
def test_slot_layout_attention_matches_the_reference_on_cuda() -> None:
    from tests.workers.test_triton_attention import make_step, reference

    step = make_step([1, 1, 37, 5], [16, 90, 0, 33], num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                     dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros((8, step["block_tables"].shape[1]), dtype=torch.long, device="cuda")
    tables[[0, 1, 4, 5]] = step["block_tables"]
    seq_lens = torch.ones(8, dtype=torch.long, device="cuda")
    seq_lens[[0, 1, 4, 5]] = step["seq_lens"]
    query_start = torch.tensor([0, 1, 2, 2, 2, 39, 44, 44, 44], device="cuda")
    q = torch.full((64, 32, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    q[:44] = step["q"]
    out = triton_attention.paged_attention_slots(q, step["k_cache"], step["v_cache"], tables, seq_lens,
                                                 query_start, 128**-0.5, num_decode_slots=4)
    ref = reference(step, 128**-0.5)
    assert float((out[:44].double().cpu() - ref).norm() / ref.norm()) < 1e-2


# -- the static-buffer forward against the eager runner -----------------------------------


class _FakeGraph:
    """torch.cuda.CUDAGraph on CPU: replay() re-runs, eagerly, the forward it "captured"."""

    def __init__(self) -> None:
        self.replay_fn = None
        self.num_replays = 0

    def reset(self) -> None:
        self.replay_fn = None

    def pool(self) -> str:
        return "pool"

    def replay(self) -> None:
        self.num_replays += 1
        self.replay_fn()


@pytest.fixture
def nan_for_uninitialized(monkeypatch) -> None:
    """torch.empty_like fills floating tensors with NaN: a row read before anything wrote it
    shows in every run, not once in a while (freed memory holds NaN bit patterns but rarely)."""
    empty_like = torch.empty_like

    def poisoned(tensor, *args, **kwargs):
        out = empty_like(tensor, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", poisoned)


@pytest.fixture
def fake_mixed_graphs(monkeypatch) -> None:
    last = {}
    forward = MixedGraphs._forward

    def recording_forward(self, size):
        last["call"] = lambda: forward(self, size)
        return forward(self, size)

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        yield
        graph.replay_fn = last["call"]

    monkeypatch.setattr(MixedGraphs, "_forward", recording_forward)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_static_buffer_mixed_steps_match_eager_steps(tiny_checkpoints, fake_mixed_graphs) -> None:
    """Chunks with and without a cached prefix next to decodes, over several steps: the graph
    path's logits for the sampled rows are the eager path's (padding rows change nothing)."""
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu",
                          num_kv_blocks=96, block_size=4)
    runner = ModelRunner(config, SINGLE_DEVICE)
    graphs = MixedGraphs(runner.model, runner.kv_caches, block_size=4, max_model_len=runner.max_model_len,
                         scratch_block=runner.num_kv_blocks, max_tokens=64, num_decode_slots=4,
                         hidden_size=runner.model_config.hidden_size, device=runner.device,
                         num_prefill_slots=2)
    graphs.capture()
    rng = random.Random(3)
    tables = [list(range(12 * i, 12 * i + 12)) for i in range(6)]  # 48 positions each
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(5, 20))] for _ in range(6)]
    done = [0] * 6  # tokens of each sequence in the KV cache
    next_ids = [None] * 6
    num_mixed = 0
    for step in range(12):
        chunks, decodes = [], []
        for i in range(6):
            if done[i] < len(prompts[i]) and len(chunks) < 2:  # prefill in chunks of up to 7 tokens
                chunk = prompts[i][done[i]:done[i] + 7]
                chunks.append(SequenceWork(f"r{i}", chunk, done[i], tables[i],
                                           done[i] + len(chunk) == len(prompts[i]), GREEDY))
            elif next_ids[i] is not None and len(decodes) < 4:
                decodes.append(SequenceWork(f"r{i}", [next_ids[i]], done[i], tables[i], True, GREEDY))
        works = chunks + decodes
        rng.shuffle(works)
        if not graphs.can_run(works):  # the last steps: decodes only
            break
        num_mixed += 1
        eager, eager_works = runner.forward(StepBatch(step, works), use_graphs=False)  # writes the same K/V
        hidden, rows = graphs.run(works)
        for w in works:
            done[int(w.req_id[1:])] += len(w.token_ids)
        if eager is None:  # only chunks that do not end their prompt
            assert len(rows) == 0
            continue
        graph = runner.model.compute_logits(hidden[rows]).float()
        assert graph.shape == eager.shape
        assert float((graph - eager.float()).abs().max() / eager.float().abs().max()) < 1e-5
        for w, token in zip(eager_works, eager.float().argmax(-1).tolist(), strict=True):
            next_ids[int(w.req_id[1:])] = token
    assert num_mixed >= 6 and sum(g.num_replays for g in graphs.graphs.values()) == num_mixed


def test_engine_on_the_mixed_graph_path_gives_the_eager_greedy_tokens(
        tiny_checkpoints, fake_mixed_graphs, nan_for_uninitialized, monkeypatch) -> None:
    """The runner's mixed branch inside the real engine (chunked prefills beside decodes), against
    an engine that runs every step eagerly; uninitialized memory reads as NaN."""
    from scheduler.engine import LLMEngine

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    config = dict(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu", block_size=4,
                  num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=32)
    with LLMEngine(EngineConfig(**config)) as engine:
        expected = [r.token_ids for r in engine.generate(prompts, greedy)]
    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    monkeypatch.setattr("workers.runner_build.DecodeGraphs.capture", lambda self: None)  # decodes eager
    with LLMEngine(EngineConfig(**config, cuda_graph_max_tokens=32)) as engine:
        graphs = engine.executor.runner.mixed_graphs
        assert graphs is not None and graphs.sizes == [16, 32]
        results = [r.token_ids for r in engine.generate(prompts, greedy)]
        assert sum(g.num_replays for g in graphs.graphs.values()) > 0
    assert results == expected


def test_the_cpu_stand_in_attends_every_row_of_the_bucket_padding_included() -> None:
    """The padding rows' attention output was left uninitialized (torch.empty_like) on the eager
    stand-in's path; whatever it held (NaN at times) went into the scratch block's K/V, which a
    decode's padded table reads (masked, but 0 * NaN is NaN): the engine's tokens turned to 0 in
    about one run in ten. Every row of the bucket now belongs to a decode or a chunk."""
    graphs = _graphs()
    works = [_work(0, [11, 12, 13], 4, [5, 6]), _work(1, [21], 7, [3, 8])]
    with torch.inference_mode():
        graphs._load_inputs(works, 16)
    meta = graphs._host_meta
    covered = set(range(meta.num_decode_tokens))
    for chunk in meta.prefills:
        covered |= set(range(chunk.token_start, chunk.token_start + chunk.num_tokens))
    assert covered == set(range(16))


def test_the_capture_leaves_the_scratch_block_clean(tiny_checkpoints, fake_mixed_graphs,
                                                     nan_for_uninitialized) -> None:
    """The capture's forwards run on dummy rows in no slot (on CPU, rows no chunk owns; on CUDA,
    rows of empty slots): their attention output was uninitialized, and their K/V went into the
    scratch block, which a decode's padded table reads masked (0 * NaN is NaN): with NaN there,
    every decode step without a padding row turned its sequences' tokens to 0."""
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu",
                          num_kv_blocks=32, block_size=4)
    runner = ModelRunner(config, SINGLE_DEVICE)
    graphs = MixedGraphs(runner.model, runner.kv_caches, block_size=4, max_model_len=runner.max_model_len,
                         scratch_block=runner.num_kv_blocks, max_tokens=32, num_decode_slots=4,
                         hidden_size=runner.model_config.hidden_size, device=runner.device,
                         num_prefill_slots=2)
    graphs.capture()
    scratch = runner.kv_caches[:, :, runner.num_kv_blocks]
    assert bool(torch.isfinite(runner.kv_caches).all()) and not scratch.any()
