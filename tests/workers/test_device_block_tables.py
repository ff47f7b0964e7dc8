"""The persistent device block tables: after every step's diff the rows of the step's sequences
hold exactly their block tables (what the old per-step upload built from scratch), across random
steps with appends, newcomers, prefix-cache hits, preemptions and resumes, finishes announced or
not; a request keeps its row while it runs; the diff is small in steady state."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shared.sampling import SamplingParams
from shared.step import SequenceWork
from workers.device_block_tables import DeviceBlockTables

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
PAD = 999


def _work(req_id: str, blocks: list[int]) -> SequenceWork:
    return SequenceWork(req_id, [1], 0, list(blocks), True, GREEDY)


def _step(tables: DeviceBlockTables, works: list[SequenceWork], freed=()) -> tuple[np.ndarray, int]:
    """Plan, apply (as the runner does, through tensors) and return (rows, diff length)."""
    plan = tables.plan(works, freed)
    tables.apply(torch.from_numpy(plan.diff_index), torch.from_numpy(plan.diff_blocks))
    return plan.rows, len(plan.diff_index)


def _assert_rows_hold(tables: DeviceBlockTables, works: list[SequenceWork], rows: np.ndarray) -> None:
    gathered = tables.gather(torch.from_numpy(rows)).tolist()
    for work, row in zip(works, gathered, strict=True):
        assert row[: len(work.block_ids)] == work.block_ids, work.req_id


def test_random_steps_leave_every_row_equal_to_a_freshly_built_table() -> None:
    rng = random.Random(11)
    max_blocks = 12
    tables = DeviceBlockTables(8, max_blocks, PAD, CPU)
    running: dict[str, list[int]] = {}  # req_id -> its block table
    next_block, next_req = 0, 0
    num_diffs = num_entries = 0
    for _ in range(400):
        freed = []
        for req_id in list(running):
            roll = rng.random()
            if roll < 0.05:  # finishes (announced)
                del running[req_id]
                freed.append(req_id)
            elif roll < 0.08:  # preempted: announced, and resumed later with new blocks
                running[req_id] = []
                freed.append(req_id)
            elif roll < 0.10:  # its table changes without a word (a group restart, say)
                running[req_id] = [rng.randrange(500) for _ in range(len(running[req_id]))]
            elif roll < 0.12 and running[req_id]:  # a finish the scheduler reports late
                del running[req_id]
        while len(running) < 6 and rng.random() < 0.5:
            # A newcomer, at times a prefix hit on another request's first blocks.
            donor = rng.choice(list(running.values())) if running and rng.random() < 0.3 else []
            running[f"r{next_req}"] = donor[: rng.randint(0, len(donor))]
            next_req += 1
        for blocks in running.values():  # appends: none, or a block, or a whole prefill's worth
            for _ in range(rng.choice([0, 0, 1, 1, 3])):
                if len(blocks) < max_blocks:
                    blocks.append(next_block % 500)
                    next_block += 1
        works = [_work(r, b) for r, b in running.items() if b]
        rng.shuffle(works)
        rows, num_diff = _step(tables, works, freed)
        _assert_rows_hold(tables, works, rows)
        assert len(set(rows.tolist())) == len(rows) and tables.pad_row not in rows
        num_diffs += num_diff
        num_entries += sum(len(w.block_ids) for w in works)
    assert num_diffs < num_entries / 3  # the point: most of each table is already there


def test_a_request_keeps_its_row_and_sends_only_its_new_blocks() -> None:
    tables = DeviceBlockTables(4, 8, PAD, CPU)
    rows, num_diff = _step(tables, [_work("a", [5, 6]), _work("b", [7])])
    assert num_diff == 3
    rows_again, num_diff = _step(tables, [_work("b", [7, 8]), _work("a", [5, 6])])
    assert num_diff == 1  # b's new block only
    assert rows_again.tolist() == [rows[1], rows[0]]  # batch order, rows unchanged
    assert _step(tables, [_work("a", [5, 6])])[1] == 0


def test_a_freed_row_goes_to_the_next_newcomer_with_its_whole_table() -> None:
    tables = DeviceBlockTables(2, 4, PAD, CPU)
    rows, _ = _step(tables, [_work("a", [1, 2, 3]), _work("b", [4])])
    new_rows, num_diff = _step(tables, [_work("b", [4]), _work("c", [9])], freed=["a"])
    assert new_rows.tolist() == [rows[1], rows[0]] and num_diff == 1
    assert tables.gather(torch.tensor([rows[0]])).tolist()[0][:1] == [9]
    # "a" resumed after preemption: a new row, its new table whole.
    _, num_diff = _step(tables, [_work("a", [7, 8])], freed=["c"])
    assert num_diff == 2 and tables.row_of("a") is not None and tables.num_rows_in_use == 2


def test_when_rows_run_out_the_least_recently_used_outside_the_step_is_taken_back() -> None:
    tables = DeviceBlockTables(2, 4, PAD, CPU)
    _step(tables, [_work("a", [1])])
    _step(tables, [_work("b", [2])])
    _step(tables, [_work("b", [2])])
    works = [_work("b", [2]), _work("c", [3])]  # nobody said "a" left: its row is the oldest
    rows, _ = _step(tables, works)
    _assert_rows_hold(tables, works, rows)
    assert tables.row_of("a") is None
    with pytest.raises(RuntimeError, match="3 sequences outgrows 2"):
        tables.plan([_work("x", [1]), _work("y", [2]), _work("z", [3])])


def test_the_pad_row_holds_the_pad_block_and_slots_come_from_rows_and_columns() -> None:
    tables = DeviceBlockTables(2, 3, PAD, CPU)
    rows, _ = _step(tables, [_work("a", [4, 5])])
    assert tables.table[tables.pad_row].tolist() == [PAD] * 3
    index = torch.tensor([rows[0] * 3 + 0, rows[0] * 3 + 1, tables.pad_row * 3])
    slots = tables.slots(index, torch.tensor([3, 0, 0]), block_size=4)
    assert slots.tolist() == [4 * 4 + 3, 5 * 4, PAD * 4]


def test_block_ids_past_the_tables_columns_are_left_out() -> None:
    tables = DeviceBlockTables(1, 2, PAD, CPU)
    rows, num_diff = _step(tables, [_work("a", [1, 2, 3])])
    assert num_diff == 2 and tables.gather(torch.from_numpy(rows)).tolist() == [[1, 2]]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_in_the_engine_rows_come_back_as_requests_finish_or_are_preempted(tiny_checkpoints, monkeypatch,
                                                                          async_scheduling) -> None:
    """The scheduler's frees reach the runner (StepBatch.freed_req_ids): with many more requests
    than rows, finishes and preemptions (a cache too small for all of them) give rows back, and
    no row ever has to be taken back unannounced."""
    from scheduler.engine import LLMEngine
    from scheduler.scheduler import Scheduler
    from shared.config import EngineConfig

    preempted = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, request, plan: (preempted.append(request.req_id),
                                                                            preempt(self, request, plan)))
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(4, 24))] for _ in range(12)]
    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", device="cpu", block_size=4,
                          num_kv_blocks=16, max_num_seqs=3, async_scheduling=async_scheduling)
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        tables = engine.executor.runner.block_tables
        assert [len(r.token_ids) for r in results] == [12] * len(prompts)
        assert preempted, "no request was preempted: the cache is not small enough for this test"
        assert tables.num_evictions == 0
        assert tables.num_rows_in_use <= config.max_num_seqs


def test_a_free_in_a_step_with_nothing_to_run_waits_for_the_next_batch() -> None:
    """An abort while nothing else runs makes a batch without works, which no runner sees: the
    free comes with the next batch that has works."""
    from shared.step import SampledToken, StepResult
    from tests.scheduler.test_scheduler import make_request, make_scheduler

    scheduler = make_scheduler()
    scheduler.add_request(make_request("a"))
    output = scheduler.schedule()
    assert output.batch.freed_req_ids == []
    scheduler.update_from_output(output, StepResult(output.batch.step_id, [SampledToken("a", 11)]))
    scheduler.abort_request("a")
    idle = scheduler.schedule()
    assert idle.batch.works == []
    scheduler.update_from_output(idle, StepResult(idle.batch.step_id, []))
    scheduler.add_request(make_request("b"))
    assert scheduler.schedule().batch.freed_req_ids == ["a"]
