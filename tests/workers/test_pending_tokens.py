"""A step's pending input tokens, taken from the previous step's samples on the device: the
scatter into the decode-first layout, the runner launching step n+1 before finishing step n
(eager, decode-graph and mixed-graph paths, the graphs faked on CPU), and on CUDA no host
synchronisation before the sampled ids' copy is read."""

from __future__ import annotations

import random

import pytest
import torch

from shared.config import EngineConfig
from shared.sampling import SamplingParams
from shared.step import SequenceWork, StepBatch
from tests.workers.test_cuda_paths import fake_cuda_graphs  # noqa: F401 - a fixture
from tests.workers.test_mixed_graphs import fake_mixed_graphs  # noqa: F401 - a fixture
from workers.cuda_graphs import DecodeGraphs
from workers.mixed_graphs import MixedGraphs
from workers.model_runner import ModelRunner
from workers.parallel import SINGLE_DEVICE
from workers.pending_tokens import PendingTokens

GREEDY = SamplingParams(temperature=0.0)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _work(req_id: str, tokens: list[int], pos: int, blocks: list[int], pending: bool = False) -> SequenceWork:
    return SequenceWork(req_id, tokens, pos, blocks, True, GREEDY, is_token_pending=pending)


def test_pending_rows_take_the_previous_steps_ids_by_request_in_the_decode_first_layout() -> None:
    pending = PendingTokens(torch.device("cpu"))
    previous = [_work("a", [1], 3, [0]), _work("b", [2], 3, [1]), _work("c", [3, 4], 0, [2])]
    pending.keep(previous, torch.tensor([70, 80, 90]))
    # Decodes first: row 0 "c" (pending), row 1 "x" (known), row 2 "a" (pending); the chunk after.
    works = [_work("c", [0], 2, [2], pending=True), _work("y", [5, 6, 7], 0, [3]), _work("x", [9], 4, [4]),
             _work("a", [0], 4, [0, 5], pending=True)]
    token_ids = torch.tensor([0, 9, 0, 5, 6, 7])
    pending.fill(token_ids, works)
    assert token_ids.tolist() == [90, 9, 70, 5, 6, 7]


def test_a_pending_row_the_previous_step_did_not_sample_is_refused() -> None:
    pending = PendingTokens(torch.device("cpu"))
    pending.keep([_work("a", [1], 3, [0])], torch.tensor([70]))
    with pytest.raises(RuntimeError, match="'?b'?: its input is the previous step's token"):
        pending.fill(torch.zeros(1, dtype=torch.long), [_work("b", [0], 3, [1], pending=True)])
    pending.keep([], None)  # a step that sampled nothing: nothing to take from
    with pytest.raises(RuntimeError, match="a: its input"):
        pending.fill(torch.zeros(1, dtype=torch.long), [_work("a", [0], 4, [0, 1], pending=True)])


def _runner(folder, **config) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(folder), dtype="float32", device="cpu", block_size=4,
                                    num_kv_blocks=64, **config), SINGLE_DEVICE)


def test_the_runner_launches_the_next_step_before_it_finishes_this_one(tiny_checkpoints) -> None:
    folder = tiny_checkpoints["llama"]
    prefill = [_work("a", [5, 6, 7, 8, 9], 0, [0, 1]), _work("b", [11, 12, 13], 0, [2])]
    sync = _runner(folder)
    first = [t.token_id for t in sync.execute(StepBatch(0, prefill)).sampled]
    decodes = [_work("a", [first[0]], 5, [0, 1]), _work("b", [first[1]], 3, [2])]
    second = [t.token_id for t in sync.execute(StepBatch(1, decodes)).sampled]

    runner = _runner(folder, async_scheduling=True)
    launched = runner.launch(StepBatch(0, prefill))
    ahead = [_work("a", [0], 5, [0, 1], pending=True), _work("b", [0], 3, [2], pending=True)]
    launched_ahead = runner.launch(StepBatch(1, ahead))
    assert [t.token_id for t in runner.finish(launched).sampled] == first
    assert [t.token_id for t in runner.finish(launched_ahead).sampled] == second


def test_a_runner_without_async_scheduling_refuses_a_pending_input(tiny_checkpoints) -> None:
    runner = _runner(tiny_checkpoints["llama"])
    with pytest.raises(RuntimeError, match="pending input token"):
        runner.launch(StepBatch(0, [_work("a", [0], 4, [0, 1], pending=True)]))


def _engine_tokens(config: dict, prompts, max_tokens: int = 10) -> tuple[list[list[int]], object]:
    from scheduler.engine import LLMEngine

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLMEngine(EngineConfig(**config)) as engine:
        tokens = [r.token_ids for r in engine.generate(prompts, greedy)]
        return tokens, engine.executor.runner


def test_async_engine_on_the_decode_graph_path_gives_the_eager_tokens(tiny_checkpoints, fake_cuda_graphs,  # noqa: F811
                                                                     monkeypatch) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 30))] for _ in range(7)]
    config = dict(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu", block_size=4,
                  num_kv_blocks=256, max_num_seqs=6)
    expected, _ = _engine_tokens(config, prompts)
    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    replays = []
    run = DecodeGraphs.run

    def counting_run(self, works, *args):
        replays.append(any(w.is_token_pending for w in works))
        return run(self, works, *args)

    monkeypatch.setattr(DecodeGraphs, "run", counting_run)
    tokens, _ = _engine_tokens({**config, "cuda_graph_max_batch_size": 4, "cuda_graph_max_tokens": 0,
                                "async_scheduling": True}, prompts)
    assert tokens == expected
    assert any(replays), "no decode step with a pending input took the graph path"


def test_async_engine_on_the_mixed_graph_path_gives_the_eager_tokens(tiny_checkpoints, fake_mixed_graphs,  # noqa: F811
                                                                    monkeypatch) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 40))] for _ in range(9)]
    config = dict(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu", block_size=4,
                  num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=32)
    expected, _ = _engine_tokens(config, prompts)
    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    monkeypatch.setattr("workers.runner_build.DecodeGraphs.capture", lambda self: None)  # decodes eager
    replays = []
    run = MixedGraphs.run

    def counting_run(self, works, *args):
        replays.append(any(w.is_token_pending for w in works))
        return run(self, works, *args)

    monkeypatch.setattr(MixedGraphs, "run", counting_run)
    tokens, _ = _engine_tokens({**config, "cuda_graph_max_tokens": 32, "async_scheduling": True}, prompts)
    assert tokens == expected
    assert any(replays), "no mixed step with a pending input took the graph path"


@needs_cuda
def test_launching_a_step_with_pending_inputs_does_not_synchronise(tiny_checkpoints) -> None:
    """The step ahead's inputs (the gather from the previous step's samples), forward, LM head,
    sampling and the ids' copy run under sync-debug "error": only finish() waits."""
    runner = ModelRunner(EngineConfig(model=str(tiny_checkpoints["llama"]), device="cuda", dtype="bfloat16",
                                      block_size=4, num_kv_blocks=64, max_num_seqs=8, async_scheduling=True),
                         SINGLE_DEVICE)
    prefill = [_work("a", [5, 6, 7, 8, 9], 0, [0, 1]), _work("b", [11, 12, 13], 0, [2])]
    runner.finish(runner.launch(StepBatch(0, prefill)))  # warm-up (compiles, pinned buffers)
    runner.finish(runner.launch(StepBatch(1, [_work("a", [0], 5, [0, 1], pending=True),
                                              _work("b", [0], 3, [2], pending=True)])))
    # "b" reaches position 4 here: its second block comes with this step.
    first = runner.launch(StepBatch(2, [_work("a", [0], 6, [0, 1], pending=True),
                                        _work("b", [0], 4, [2, 4], pending=True),
                                        _work("c", [1, 2, 3], 0, [3])]))
    torch.cuda.set_sync_debug_mode("error")
    try:
        ahead = runner.launch(StepBatch(3, [_work("a", [0], 7, [0, 1], pending=True),
                                            _work("b", [0], 5, [2, 4], pending=True),
                                            _work("c", [0], 3, [3], pending=True)]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(runner.finish(first).sampled) == 3 and len(runner.finish(ahead).sampled) == 3


def _launch_path_steps() -> list[list[SequenceWork]]:
    """Steps ahead, each launched before the last is finished: a mixed step, decodes, a mixed
    step with a newcomer, decodes, then a step too big for a graph. Pending tokens throughout."""
    def ahead(req_id, pos, blocks):
        return _work(req_id, [0], pos, blocks, pending=True)

    return [
        [_work("a", [5, 6, 7, 8, 9], 0, [0, 1]), _work("b", [11, 12, 13], 0, [2])],
        [ahead("a", 5, [0, 1]), ahead("b", 3, [2])],
        [ahead("a", 6, [0, 1]), ahead("b", 4, [2, 4]), _work("c", [1, 2, 3], 0, [3])],
        [ahead("a", 7, [0, 1]), ahead("b", 5, [2, 4]), ahead("c", 3, [3])],
        [ahead("a", 8, [0, 1, 5]), ahead("b", 6, [2, 4]), ahead("c", 4, [3, 6]),
         _work("d", list(range(20, 40)), 0, [7, 8, 9, 10, 11])],
    ]


def test_launching_steps_ahead_reads_nothing_of_the_device_on_any_path(tiny_checkpoints, monkeypatch) -> None:
    """The CPU twin of the CUDA test below, over the decode-graph, mixed-graph and eager paths
    (graphs not captured: their code runs eagerly over their static buffers): no launch reads a
    tensor's values on the host (tests/workers/host_reads.py), and the tokens are the sync ones."""
    from tests.workers.host_reads import no_host_reads

    folder = tiny_checkpoints["llama"]
    steps = _launch_path_steps()
    sync = _runner(folder)
    expected, last = [], {}
    for step_id, works in enumerate(steps):
        known = [SequenceWork(w.req_id, [last[w.req_id]] if w.is_token_pending else w.token_ids, w.start_pos,
                              w.block_ids, True, GREEDY) for w in works]
        sampled = sync.execute(StepBatch(step_id, known)).sampled
        expected.append([t.token_id for t in sampled])
        last.update((t.req_id, t.token_id) for t in sampled)

    monkeypatch.setattr("workers.runner_build.use_cuda_graphs", lambda config, device: True)
    monkeypatch.setattr(DecodeGraphs, "capture", lambda self: None)
    monkeypatch.setattr(MixedGraphs, "capture", lambda self: None)
    paths = []
    for cls, name in ((DecodeGraphs, "decode graph"), (MixedGraphs, "mixed graph")):
        def run(self, *args, _run=cls.run, _name=name):
            paths.append(_name)
            return _run(self, *args)
        monkeypatch.setattr(cls, "run", run)
    runner = _runner(folder, async_scheduling=True, max_num_seqs=8, cuda_graph_max_batch_size=8,
                     cuda_graph_max_tokens=16)
    launched = [runner.launch(StepBatch(0, steps[0]))]
    tokens = []
    for step_id, works in enumerate(steps[1:], start=1):
        with no_host_reads():
            launched.append(runner.launch(StepBatch(step_id, works)))
        tokens.append([t.token_id for t in runner.finish(launched[-2]).sampled])
    tokens.append([t.token_id for t in runner.finish(launched[-1]).sampled])
    assert paths == ["mixed graph", "decode graph", "mixed graph", "decode graph"]  # then eager
    assert tokens == expected


def test_the_host_read_guard_catches_a_read() -> None:
    from tests.workers.host_reads import HostReadError, no_host_reads

    ids = torch.tensor([1, 2, 3])
    with no_host_reads():
        ids.index_select(0, torch.tensor([2, 0]))  # kernels only: allowed
        reads = (lambda: ids.tolist(), lambda: int(ids[0]), lambda: ids[ids > 1], lambda: bool(ids.any()))
        for read in reads:
            with pytest.raises(HostReadError):
                read()


def test_penalized_steps_ahead_and_late_sampled_steps_give_the_sync_tokens_reading_nothing(
        tiny_checkpoints) -> None:
    """Penalized rows with pending inputs (their last token counted on the device) and steps
    launched to sample late (`StepBatch.samples_late`, sampled by `ModelRunner.sample` before the
    next launch) give the tokens of steps run one at a time with the whole history, and no launch
    nor late sampling reads a tensor's values on the host."""
    from tests.workers.host_reads import no_host_reads

    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.9)
    folder = tiny_checkpoints["llama"]
    steps = _launch_path_steps()
    sync = _runner(folder)
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    expected = []
    for step_id, works in enumerate(steps):
        known = []
        for w in works:
            prompts.setdefault(w.req_id, w.token_ids)
            out = outputs.setdefault(w.req_id, [])
            known.append(SequenceWork(w.req_id, [out[-1]] if w.is_token_pending else w.token_ids, w.start_pos,
                                      w.block_ids, True, penalized, prompt_token_ids=prompts[w.req_id],
                                      output_token_ids=list(out)))
        sampled = sync.execute(StepBatch(step_id, known)).sampled
        expected.append([t.token_id for t in sampled])
        for t in sampled:
            outputs[t.req_id].append(t.token_id)

    runner = _runner(folder, async_scheduling=True, max_num_seqs=8)
    known: dict[str, list[int]] = {}  # the tokens the host has taken back
    tokens, previous = [], None
    for step_id, works in enumerate(steps):
        # A pending row's history lacks its pending token: the previous step's, not back yet.
        ahead = [SequenceWork(w.req_id, w.token_ids, w.start_pos, w.block_ids, True, penalized,
                              prompt_token_ids=prompts[w.req_id],
                              output_token_ids=list(known.get(w.req_id, [])),
                              is_token_pending=w.is_token_pending) for w in works]
        batch = StepBatch(step_id, ahead, samples_late=step_id % 2 == 1)
        with no_host_reads():
            step = runner.launch(batch)
        assert (step.late is not None) == batch.samples_late
        if previous is not None:
            sampled = runner.finish(previous).sampled
            tokens.append([t.token_id for t in sampled])
            for t in sampled:
                known.setdefault(t.req_id, []).append(t.token_id)
        with no_host_reads():
            runner.sample(step)  # a late step's sampling: after the previous step is back
        previous = step
    tokens.append([t.token_id for t in runner.finish(previous).sampled])
    assert tokens == expected
