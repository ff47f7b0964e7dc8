"""Which code paths run where: CUDA graphs and the Triton attention kernel only on CUDA, so the
suite stays green on CPUs; the graph path's inputs and padding, checked here by running its
static-buffer forward eagerly; and, where a GPU is present, graphs against eager steps."""

from __future__ import annotations

import gc
import itertools
import random

import pytest
import torch

from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from workers.cuda_graphs import DecodeGraphs, capture_sizes, use_cuda_graphs
from workers.layers import triton_attention, triton_fused
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE
from workers.step_inputs import build_step_inputs

GREEDY = SamplingParams(temperature=0.0)


def _runner(folder, **config) -> ModelRunner:
    base = dict(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    return ModelRunner(EngineConfig(**{**base, **config}), SINGLE_DEVICE)


# -- selection -------------------------------------------------------------------------


def test_cuda_graphs_are_selected_only_for_cuda_devices() -> None:
    config = EngineConfig(model="unused")
    assert not use_cuda_graphs(config, torch.device("cpu"))
    assert use_cuda_graphs(config, torch.device("cuda")) == (triton_attention.triton is not None)
    assert not use_cuda_graphs(EngineConfig(model="unused", cuda_graphs=False), torch.device("cuda"))
    no_sizes = EngineConfig(model="unused", cuda_graph_max_batch_size=0)
    assert not use_cuda_graphs(no_sizes, torch.device("cuda"))


def test_triton_kernels_are_never_picked_for_cpu_tensors() -> None:
    assert not triton_attention.is_available(torch.zeros(2, 4, 16))
    assert not triton_fused.is_available(torch.zeros(2, 4, 16))


@pytest.mark.skipif(triton_attention.triton is None, reason="needs Triton installed")
def test_kernels_do_not_specialise_on_arguments_that_change_every_step() -> None:
    """Step-buffer views (their alignment), table widths and sequence counts change from step
    to step; a kernel specialised on them compiled new variants while serving (2.3x slower
    on the H200 workload)."""
    def flags(kernel) -> dict[str, tuple[bool, bool]]:
        return {p.name: (p.do_not_specialize, p.do_not_specialize_on_alignment) for p in kernel.params}

    attention = flags(triton_attention._paged_attention_kernel)
    assert attention["num_seqs"][0] and attention["stride_table_seq"][0]
    assert all(attention[name][1] for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr"))
    rope = flags(triton_fused._rope_and_store_kernel)
    assert rope["positions_ptr"][1] and rope["slots_ptr"][1]


def test_runner_on_cpu_runs_eagerly_and_keeps_a_scratch_block(tiny_checkpoints) -> None:
    runner = _runner(tiny_checkpoints["llama"], cuda_graphs=True)
    assert runner.decode_graphs is None
    assert runner.num_kv_blocks == 64  # what the scheduler sees
    assert runner.kv_caches.shape[2] == 65  # plus the scratch block graphs pad into


def test_capture_sizes_cover_every_batch_size_with_the_smallest_padding() -> None:
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    graphs = DecodeGraphs(None, None, block_size=4, max_model_len=64, scratch_block=9, max_batch_size=256,
                          device=torch.device("cpu"))
    for n in range(1, 257):
        size = graphs.padded_size(n)
        assert size >= n and not any(n <= s < size for s in sizes)
    assert graphs.padded_size(257) is None


# -- graph inputs ------------------------------------------------------------------------


def _decode_work(i: int, pos: int, blocks: list[int]) -> SequenceWork:
    return SequenceWork(f"r{i}", [100 + i], pos, blocks, True, GREEDY)


def test_graph_inputs_pad_rows_onto_the_scratch_block() -> None:
    graphs = DecodeGraphs(None, None, block_size=4, max_model_len=64, scratch_block=9, max_batch_size=8,
                          device=torch.device("cpu"))
    assert graphs.block_tables.shape == (8, 16)  # max_model_len / block_size columns
    with torch.inference_mode():
        big = [_decode_work(i, 10 + i, [i, 20 + i, 30 + i, 40 + i]) for i in range(6)]
        graphs._load_inputs(big, graphs.padded_size(len(big)))
        small = [_decode_work(0, 5, [3, 7]), _decode_work(1, 8, [4, 5, 6])]
        graphs._load_inputs(small, graphs.padded_size(len(small)))
    assert graphs.padded_size(2) == 2 and graphs.padded_size(3) == 4
    assert graphs.token_ids[:2].tolist() == [100, 101]
    assert graphs.positions[:2].tolist() == [5, 8]
    assert graphs.context_lens[:2].tolist() == [6, 9]
    assert graphs.slot_mapping[:2].tolist() == [7 * 4 + 1, 6 * 4 + 0]
    assert graphs.block_tables[0, :2].tolist() == [3, 7] and graphs.block_tables[1, :3].tolist() == [4, 5, 6]
    with torch.inference_mode():
        graphs._load_inputs(small[:1] + [_decode_work(2, 0, [8])] * 2, 4)  # 3 works padded to 4
    # The padding row (and only it) writes the scratch block and attends over it alone.
    assert graphs.token_ids[3].item() == 0 and graphs.positions[3].item() == 0
    assert graphs.slot_mapping[3].item() == 9 * 4
    assert graphs.context_lens[3].item() == 1
    assert graphs.block_tables[3, 0].item() == 9


def test_graph_inputs_refuse_a_block_table_that_does_not_cover_the_position() -> None:
    graphs = DecodeGraphs(None, None, block_size=4, max_model_len=64, scratch_block=9, max_batch_size=8,
                          device=torch.device("cpu"))
    with torch.inference_mode(), pytest.raises(ValueError, match="r0"):
        graphs._load_inputs([_decode_work(0, 8, [1, 2])], 1)


def test_only_decode_only_fully_sampled_batches_take_the_graph_path() -> None:
    graphs = DecodeGraphs(None, None, block_size=4, max_model_len=64, scratch_block=9, max_batch_size=8,
                          device=torch.device("cpu"))
    decodes = [_decode_work(i, 3, [i]) for i in range(3)]
    assert graphs.can_run(decodes)
    assert not graphs.can_run([])
    assert not graphs.can_run(decodes + [SequenceWork("p", [1, 2, 3], 0, [5], True, GREEDY)])
    assert not graphs.can_run(decodes + [SequenceWork("c", [1], 0, [5], False, GREEDY)])
    assert not graphs.can_run([_decode_work(i, 3, [i]) for i in range(9)])  # above the largest size
    assert not graphs.can_run([_decode_work(0, 64, list(range(17)))])  # past max_model_len


@pytest.mark.parametrize("num_seqs", [1, 3, 5])
def test_static_buffer_decode_matches_eager_decode(num_seqs, tiny_checkpoints) -> None:
    """The graph path's forward over padded static buffers, run eagerly on CPU, gives the eager
    path's logits for the real rows, step after step (padding rows change nothing)."""
    runner = _runner(tiny_checkpoints["llama"])
    graphs = DecodeGraphs(runner.model, runner.kv_caches, block_size=4, max_model_len=runner.max_model_len,
                          scratch_block=runner.num_kv_blocks, max_batch_size=8, device=runner.device)
    rng = random.Random(num_seqs)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 13))] for _ in range(num_seqs)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(num_seqs)]  # 32 slots each
    works = [SequenceWork(f"r{i}", p, 0, t, True, GREEDY)
             for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    next_ids = runner.forward(StepBatch(0, works), use_graphs=False)[0].float().argmax(-1).tolist()
    positions = [len(p) for p in prompts]
    for step in range(1, 6):
        works = [SequenceWork(f"r{i}", [next_ids[i]], positions[i], tables[i], True, GREEDY)
                 for i in range(num_seqs)]
        eager = runner.forward(StepBatch(step, works), use_graphs=False)[0].float()  # writes the same K/V
        graph = graphs.run(works).float()
        assert graph.shape == eager.shape
        assert float((graph - eager).abs().max() / eager.abs().max()) < 1e-5
        next_ids = eager.argmax(-1).tolist()
        positions = [p + 1 for p in positions]


# -- step inputs ---------------------------------------------------------------------------


def _reference_inputs(works: list[SequenceWork], block_size: int) -> dict[str, list[int]]:
    """The per-token loop build_step_inputs replaced."""
    ordered = [w for w in works if len(w.token_ids) == 1] + [w for w in works if len(w.token_ids) > 1]
    token_ids, positions, slots, last_row = [], [], [], {}
    for w in ordered:
        token_ids.extend(w.token_ids)
        for pos in range(w.start_pos, w.start_pos + len(w.token_ids)):
            positions.append(pos)
            slots.append(w.block_ids[pos // block_size] * block_size + pos % block_size)
        last_row[w.req_id] = len(token_ids) - 1
    return {"token_ids": token_ids, "positions": positions, "slots": slots,
            "sample_rows": [last_row[w.req_id] for w in works if w.is_sampled]}


def test_vectorized_step_inputs_match_the_per_token_reference() -> None:
    rng = random.Random(0)
    for _ in range(100):
        block_size = rng.choice([1, 4, 16])
        works = []
        for i in range(rng.randint(1, 8)):
            start = rng.randint(0, 60)
            n = 1 if rng.random() < 0.5 else rng.randint(1, 30)
            blocks = rng.sample(range(1000), -(-(start + n) // block_size) + rng.randint(0, 2))
            works.append(SequenceWork(f"r{i}", [rng.randrange(500) for _ in range(n)], start, blocks,
                                      rng.random() < 0.7, GREEDY))
        inputs = build_step_inputs(StepBatch(0, works), block_size, torch.device("cpu"))
        ref = _reference_inputs(works, block_size)
        assert inputs.token_ids.tolist() == ref["token_ids"]
        assert inputs.positions.tolist() == ref["positions"]
        assert inputs.meta.slot_mapping.tolist() == ref["slots"]
        assert inputs.sample_rows.tolist() == ref["sample_rows"]
        decodes = [w for w in works if len(w.token_ids) == 1]
        if decodes:
            assert inputs.meta.decode_context_lens.tolist() == [w.start_pos + 1 for w in decodes]
            for row, w in zip(inputs.meta.decode_block_tables.tolist(), decodes, strict=True):
                needed = -(-(w.start_pos + 1) // block_size)
                assert row[:needed] == w.block_ids[:needed]
        prefills = [w for w in works if len(w.token_ids) > 1]
        # Each chunk's table: the blocks its context needs (a view of its row of the step's table).
        assert [c.block_table.tolist() for c in inputs.meta.prefills] == [
            w.block_ids[: -(-(w.start_pos + len(w.token_ids)) // block_size)] for w in prefills]
        # What the CUDA kernel reads: every sequence, decodes first.
        ordered = decodes + prefills
        meta = inputs.meta
        assert meta.seq_lens.tolist() == [w.start_pos + len(w.token_ids) for w in ordered]
        query_lens = [len(w.token_ids) for w in ordered]
        assert meta.query_start_loc.tolist() == [0] + list(itertools.accumulate(query_lens))
        assert meta.max_query_len == max(len(w.token_ids) for w in ordered)
        for row, w in zip(meta.block_tables.tolist(), ordered, strict=True):
            needed = -(-(w.start_pos + len(w.token_ids)) // block_size)
            assert row[:needed] == w.block_ids[:needed]


def test_step_inputs_refuse_a_block_table_that_does_not_cover_the_step() -> None:
    work = SequenceWork("short", [1, 2, 3], 6, [0], True, GREEDY)  # positions 6..8 need 3 blocks of 4
    with pytest.raises(ValueError, match="short"):
        build_step_inputs(StepBatch(0, [work]), 4, torch.device("cpu"))


# -- on a GPU --------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or triton_attention.triton is None,
                                reason="needs CUDA and Triton")


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_gives_the_eager_greedy_tokens(dtype, tiny_checkpoints) -> None:
    from scheduler.engine import LLMEngine

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(11)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for use_graphs in (False, True):
        config = EngineConfig(model=str(tiny_checkpoints["llama"]), device="cuda", dtype=dtype, block_size=4,
                              num_kv_blocks=512, max_num_seqs=8, cuda_graphs=use_graphs)
        with LLMEngine(config) as engine:
            assert (engine.executor.runner.decode_graphs is not None) == use_graphs
            results[use_graphs] = [r.token_ids for r in engine.generate(prompts, greedy)]
    assert results[True] == results[False]


@needs_cuda
def test_cuda_graph_logits_match_eager_logits_on_cuda(tiny_checkpoints) -> None:
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoints["qwen2"]), device="cuda", dtype="float32",
                                      block_size=4, num_kv_blocks=64, max_num_seqs=8), SINGLE_DEVICE)
    assert runner.decode_graphs is not None and runner.decode_graphs.graphs
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    works = [SequenceWork(f"r{i}", p, 0, t, True, GREEDY)
             for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    next_ids = runner.forward(StepBatch(0, works), use_graphs=False)[0].float().argmax(-1).tolist()
    works = [SequenceWork(f"r{i}", [next_ids[i]], len(p), tables[i], True, GREEDY)
             for i, p in enumerate(prompts)]
    eager = runner.forward(StepBatch(1, works), use_graphs=False)[0].float()
    graph = runner.decode_graphs.run(works).float()
    assert torch.allclose(graph, eager, atol=1e-4, rtol=1e-4)


@needs_cuda
def test_steps_do_not_synchronise_with_the_host_before_sampling(tiny_checkpoints) -> None:
    """Inputs, forward and LM head of eager (mixed) and graph (decode) steps run under
    sync-debug "error": any host synchronisation there raises. The sampler's .tolist() after
    them is the step's only one."""
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoints["llama"]), device="cuda", dtype="bfloat16",
                                      block_size=4, num_kv_blocks=64, max_num_seqs=8), SINGLE_DEVICE)
    first = [SequenceWork("a", [5, 6, 7, 8, 9], 0, [0, 1], True, GREEDY)]
    runner.execute(StepBatch(0, first))  # warm-up, and "a" has 5 tokens cached
    mixed = [SequenceWork("a", [10], 5, [0, 1], True, GREEDY),
             SequenceWork("b", [11, 12, 13], 0, [2], True, GREEDY),
             SequenceWork("c", [14, 15], 2, [3], True, GREEDY)]  # a chunk with a cached prefix
    decodes = [SequenceWork("a", [16], 6, [0, 1], True, GREEDY),
               SequenceWork("b", [17], 3, [2], True, GREEDY)]
    runner.execute(StepBatch(1, mixed))  # warm-up of the eager kernels
    assert runner.decode_graphs is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            inputs = build_step_inputs(StepBatch(2, mixed), runner.block_size, runner.device)
            hidden = runner.model(inputs.token_ids, inputs.positions, runner.kv_caches, inputs.meta)
            eager_logits = runner.model.compute_logits(hidden[inputs.sample_rows])
            graph_logits = runner.decode_graphs.run(decodes)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert eager_logits.shape[0] == 3 and graph_logits.shape[0] == 2


def _make_tiny_checkpoint(*args, **kwargs):
    from testkit.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(*args, **kwargs)


def _reserved_after_collecting() -> int:
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


# What may stay reserved after a close: cuBLAS workspaces, which PyTorch keeps per stream for the
# life of the process (on the H200: 32 MiB for the default stream, 32 MiB for the capture stream).
CLOSE_SLACK_BYTES = 256 << 20


@needs_cuda
def test_close_gives_cuda_memory_back_so_a_second_engine_gets_as_many_kv_blocks(tmp_path) -> None:
    """The KV cache is sized from free GPU memory, so an engine built after another was closed
    must find all of it free again: graphs and their pool, KV cache, weights, the caching
    allocator's blocks. Before ModelRunner.close, the second engine of bench_gpu.py
    --max-num-seqs 512,256 on the H200 found "no memory left for the KV cache". The first engine
    stays referenced (as after a `with` block), and so do its graphs (bench_gpu.py kept them in a
    local), while the second is built."""
    from scheduler.engine import LLMEngine

    folder = _make_tiny_checkpoint("llama", tmp_path / "wide", hidden_size=512, num_attention_heads=8,
                                   num_key_value_heads=8, head_dim=64, intermediate_size=1024)
    config = EngineConfig(model=str(folder), device="cuda", dtype="bfloat16", block_size=16, max_num_seqs=32,
                          cuda_graph_max_batch_size=32, kv_cache_memory_fraction=0.5)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 60))] for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    baseline = _reserved_after_collecting()
    with LLMEngine(config, load_tokenizer_files=False) as first:
        graphs = first.executor.runner.decode_graphs
        assert graphs is not None and graphs.graphs  # the graphs' pool must come back too
        first_tokens = [r.token_ids for r in first.generate(prompts, greedy)]
        assert torch.cuda.memory_reserved() - baseline > 0.25 * torch.cuda.mem_get_info()[1]
    reserved_after_close = torch.cuda.memory_reserved()  # close() itself must empty the cache
    with LLMEngine(config, load_tokenizer_files=False) as second:
        second_tokens = [r.token_ids for r in second.generate(prompts, greedy)]
    assert reserved_after_close - baseline <= CLOSE_SLACK_BYTES, (baseline, reserved_after_close)
    # Not to the block: CUDA modules and cuBLAS handles the first engine loaded lazily stay (on the
    # H200, 0.15% fewer blocks). Before the fix the second engine got half as many, or none.
    num_blocks = (first.executor.num_kv_blocks, second.executor.num_kv_blocks)
    assert abs(num_blocks[1] - num_blocks[0]) <= 0.01 * num_blocks[0], num_blocks
    assert second_tokens == first_tokens
    assert torch.cuda.memory_reserved() - baseline <= CLOSE_SLACK_BYTES
    assert graphs.graphs == {}


# -- the capture sequence and the runner's graph path, with CUDA faked ----------------------


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() re-runs, eagerly, the forward it "captured"."""

    def __init__(self) -> None:
        self.replay_fn = None
        self.num_replays = 0
        self.is_reset = False

    def reset(self) -> None:
        self.replay_fn = None
        self.is_reset = True

    def pool(self) -> str:
        return "the-pool"

    def replay(self) -> None:
        self.num_replays += 1
        self.replay_fn()


@pytest.fixture
def fake_cuda_graphs(monkeypatch) -> list:
    """torch.cuda.graph / CUDAGraph / synchronize faked on CPU; returns the pools passed to captures."""
    import contextlib
    import inspect

    # The real context manager takes the arguments capture() passes.
    assert {"pool", "capture_error_mode"} <= set(inspect.signature(torch.cuda.graph).parameters)
    pools = []
    last_forward = {}
    forward = DecodeGraphs._forward

    def recording_forward(self, size):
        last_forward["call"] = lambda: forward(self, size)
        return forward(self, size)

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        pools.append(pool)
        yield
        graph.replay_fn = last_forward["call"]

    monkeypatch.setattr(DecodeGraphs, "_forward", recording_forward)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return pools


def test_capture_records_every_size_largest_first_in_one_pool(tiny_checkpoints, fake_cuda_graphs) -> None:
    runner = _runner(tiny_checkpoints["qwen2"])
    graphs = DecodeGraphs(runner.model, runner.kv_caches, block_size=4, max_model_len=runner.max_model_len,
                          scratch_block=runner.num_kv_blocks, max_batch_size=12, device=runner.device)
    graphs.capture()
    assert list(graphs.graphs) == [12, 8, 4, 2, 1]
    assert fake_cuda_graphs == [None] + ["the-pool"] * 4  # the first capture's pool, shared by the rest
    assert graphs.out.shape[0] == 12  # one output buffer, allocated before any capture

    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    works = [SequenceWork(f"r{i}", [7 + i], 0, tables[i], True, GREEDY) for i in range(3)]
    graph_logits = graphs.run(works).clone()
    assert graphs.graphs[4].num_replays == 1 and graph_logits.shape[0] == 3
    eager = runner.forward(StepBatch(0, works), use_graphs=False)[0].float()
    assert float((graph_logits - eager).abs().max() / eager.abs().max()) < 1e-5


def test_engine_on_the_graph_path_gives_the_eager_greedy_tokens(tiny_checkpoints, fake_cuda_graphs,
                                                                monkeypatch) -> None:
    """The runner's whole graph branch (capture at load, replay of padded decode batches, sampling
    of the graph's logits) inside the real engine, against an engine that never uses it."""
    from scheduler.engine import LLMEngine

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 30))] for _ in range(7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = dict(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu", block_size=4,
                  num_kv_blocks=256, max_num_seqs=6)
    with LLMEngine(EngineConfig(**config)) as engine:
        assert engine.executor.runner.decode_graphs is None
        expected = [r.token_ids for r in engine.generate(prompts, greedy)]
    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    # Decode graphs only: the fake graphs replay the last forward recorded, a DecodeGraphs one.
    with LLMEngine(EngineConfig(**config, cuda_graph_max_batch_size=4, cuda_graph_max_tokens=0)) as engine:
        graphs = engine.executor.runner.decode_graphs
        assert graphs is not None and list(graphs.graphs) == [4, 2, 1]
        results = [r.token_ids for r in engine.generate(prompts, greedy)]
        assert sum(g.num_replays for g in graphs.graphs.values()) > 0  # batches of 5-6 ran eagerly
    assert results == expected


def test_close_destroys_the_graphs_and_frees_their_buffers_while_a_script_still_holds_them(
        tiny_checkpoints, fake_cuda_graphs, monkeypatch) -> None:
    """bench_gpu.py kept a local of the first engine's DecodeGraphs past close(): before
    ModelRunner.close, that local held the model, the KV cache and the graph pool, and the second
    engine found no memory for its KV cache. Close now resets every graph (its pool goes back)
    and drops what the graphs hold, whoever still holds the DecodeGraphs."""
    from scheduler.engine import LLMEngine
    from tests.workers.runner_refs import alive, runner_weakrefs

    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu", block_size=4,
                          num_kv_blocks=64, max_num_seqs=4, cuda_graph_max_batch_size=4,
                          cuda_graph_max_tokens=0)
    engine = LLMEngine(config)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    graphs = engine.executor.runner.decode_graphs  # what the benchmark kept
    captured = list(graphs.graphs.values())
    assert sum(g.num_replays for g in captured) > 0
    refs = runner_weakrefs(engine.executor.runner)
    engine.close()
    assert alive(refs) == []
    assert graphs.graphs == {} and all(g.is_reset for g in captured)
