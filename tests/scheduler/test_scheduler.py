from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from scheduler.request import BATCH_PRIORITY, FinishReason, Request, RequestStatus
from scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shared.errors import InvalidRequestError, WorkerError
from shared.sampling import SamplingParams
from shared.step import SampledToken, StepBatch, StepResult

VOCAB = 1000


def next_token_after_last(history: list[int]) -> int:
    return (history[-1] + 1) % VOCAB


def next_token_from_history(history: list[int]) -> int:
    """Depends on every position, so a wrong or stale KV slot changes the output."""
    return sum((i + 1) * t for i, t in enumerate(history)) % VOCAB


class FakeRunner:
    """Writes computed tokens into a fake paged KV cache, samples from what it reads back."""

    def __init__(
        self, block_size: int = 4, next_token: Callable[[list[int]], int] = next_token_after_last
    ) -> None:
        self.block_size = block_size
        self.next_token = next_token
        self.slots: dict[tuple[int, int], tuple[str, int, int]] = {}  # -> (req_id, pos, token)
        # req_id -> its tokens, to check reads of a cached prefix another request wrote
        self.tokens_of: Callable[[str], list[int] | None] | None = None
        self.num_shared_reads = 0

    def __call__(self, batch: StepBatch) -> StepResult:
        sampled = []
        for work in batch.works:
            for pos, token in enumerate(work.token_ids, start=work.start_pos):
                self.slots[self._slot(work.block_ids, pos)] = (work.req_id, pos, token)
            if work.is_sampled:
                end = work.start_pos + len(work.token_ids)
                history = [self._read(work.req_id, work.block_ids, pos) for pos in range(end)]
                token = self.next_token(history)
                top = [(token, -0.5), (token + 1, -1.5)][: work.sampling.logprobs or 0]
                sampled.append(SampledToken(work.req_id, token, -0.5, top))
        return StepResult(batch.step_id, sampled)

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return (block_ids[pos // self.block_size], pos % self.block_size)

    def _read(self, req_id: str, block_ids: list[int], pos: int) -> int:
        owner, owner_pos, token = self.slots[self._slot(block_ids, pos)]
        # Another request's slot is fine when it is a shared prefix: the same token at the same
        # position (the history sampled from is then the reader's own).
        assert owner_pos == pos, "block table points at another position's KV"
        if owner != req_id:
            self.num_shared_reads += 1
            own = self.tokens_of(req_id) if self.tokens_of is not None else None
            assert own is not None and own[pos] == token, "block table points at someone else's KV"
        return token


class CharTokenizer:
    """Token t is the letter chr(ord('a') + t % 26)."""

    def decode(self, token_ids: list[int], **kwargs: object) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


def make_scheduler(tokenizer: object | None = None, **overrides: int | bool) -> Scheduler:
    config = dict(max_model_len=1024, num_kv_blocks=1000, block_size=4,
                  max_num_seqs=8, max_num_batched_tokens=64)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config), tokenizer)


def make_request(req_id: str, num_prompt: int = 4, first_token: int = 10, priority: int = 0,
                 arrival_time: float = 0.0, eos: tuple[int, ...] = (), **sampling) -> Request:
    sampling.setdefault("max_tokens", 5)
    prompt = [(first_token + i) % VOCAB for i in range(num_prompt)]
    return Request(req_id, prompt, SamplingParams(**sampling), priority, arrival_time, set(eos))


def step(scheduler: Scheduler, runner: FakeRunner, collected: dict[str, Collected]
         ) -> SchedulerOutput:
    """One schedule / run / update round; checks the step limits."""
    runner.tokens_of = lambda req_id: getattr(scheduler.get_request(req_id), "all_token_ids", None)
    out = scheduler.schedule()
    config = scheduler.config
    assert out.batch.num_tokens <= config.max_num_batched_tokens
    assert len(out.batch.works) <= config.max_num_seqs
    for output in scheduler.update_from_output(out, runner(out.batch)):
        entry = collected.setdefault(output.req_id, Collected())
        entry.token_ids += output.new_token_ids
        entry.text += output.text_delta
        entry.finish_reason, entry.stop_reason = output.finish_reason, output.stop_reason
    return out


def run_all(scheduler: Scheduler, requests: list[Request], next_token=next_token_after_last,
            max_steps: int = 5000) -> tuple[dict[str, Collected], list[SchedulerOutput]]:
    runner = FakeRunner(scheduler.config.block_size, next_token)
    for request in requests:
        scheduler.add_request(request)
    collected: dict[str, Collected] = {}
    outs = []
    while scheduler.has_unfinished_requests():
        outs.append(step(scheduler, runner, collected))
        assert len(outs) < max_steps, "scheduler made no progress"
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_kv_blocks
    return collected, outs


def random_requests(seed: int, num: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        make_request(f"r{i}", rng.randint(1, 30), rng.randrange(VOCAB), rng.randint(0, 2),
                     float(i), max_tokens=rng.randint(1, 20))
        for i in range(num)
    ]


def test_every_step_respects_token_budget_and_seq_cap_and_all_requests_finish() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    requests = random_requests(seed=0, num=12)
    collected, _ = run_all(scheduler, requests)
    for request in requests:
        assert len(collected[request.req_id].token_ids) == request.sampling.max_tokens
        assert collected[request.req_id].finish_reason is FinishReason.LENGTH


def test_long_prompt_is_prefilled_in_chunks_while_running_decode_goes_on_every_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner, collected = FakeRunner(), {}
    scheduler.add_request(make_request("decoding", max_tokens=50))
    step(scheduler, runner, collected)
    scheduler.add_request(make_request("long", num_prompt=40, first_token=100))
    chunks = []
    while "long" not in collected:
        out = step(scheduler, runner, collected)
        assert out.num_scheduled_tokens["decoding"] == 1
        work = next(w for w in out.batch.works if w.req_id == "long")
        assert work.is_sampled == (work.start_pos + len(work.token_ids) == 40)
        chunks.append(work)
    assert [w.start_pos for w in chunks] == [0, 7, 14, 21, 28, 35]
    assert sum((w.token_ids for w in chunks), []) == list(range(100, 140))
    assert collected["long"].token_ids == [140]
    assert len(collected["decoding"].token_ids) == 1 + len(chunks)


def test_long_prefill_chunk_lets_several_prompts_progress_in_one_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_chunk=5)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", num_prompt=12))
    scheduler.add_request(make_request("b", num_prompt=12, first_token=500))
    out = step(scheduler, runner, {})
    assert out.num_scheduled_tokens == {"a": 5, "b": 5}


def test_request_joining_mid_generation_gets_the_output_it_gets_alone() -> None:
    alone, _ = run_all(make_scheduler(), [make_request("late", 7, 300, max_tokens=12)],
                       next_token_from_history)
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner, collected = FakeRunner(next_token=next_token_from_history), {}
    scheduler.add_request(make_request("early", 9, 200, max_tokens=30))
    for _ in range(4):
        step(scheduler, runner, collected)
    scheduler.add_request(make_request("late", 7, 300, max_tokens=12))
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, collected)
    assert collected["late"].token_ids == alone["late"].token_ids
    early_alone, _ = run_all(make_scheduler(), [make_request("early", 9, 200, max_tokens=30)],
                             next_token_from_history)
    assert collected["early"].token_ids == early_alone["early"].token_ids


def test_tiny_cache_preempts_yet_output_matches_unconstrained_run() -> None:
    def run(num_kv_blocks: int):
        scheduler = make_scheduler(CharTokenizer(), num_kv_blocks=num_kv_blocks)
        return run_all(scheduler, random_requests(seed=1, num=8), next_token_from_history)

    roomy, _ = run(1000)
    tight, outs = run(14)  # 56 slots: each request alone fits (<= 50 tokens)
    assert sum(len(out.preempted_req_ids) for out in outs) > 0
    for req_id, expected in roomy.items():
        assert tight[req_id].token_ids == expected.token_ids
        # Text was streamed exactly once, even for requests that re-prefilled.
        assert tight[req_id].text == expected.text == CharTokenizer().decode(expected.token_ids)


def test_preempted_request_frees_blocks_and_resumes_first_by_recomputing_everything() -> None:
    scheduler = make_scheduler(block_size=2, num_kv_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    runner, collected = FakeRunner(block_size=2), {}
    scheduler.add_request(make_request("first", 3, 10, arrival_time=0.0, max_tokens=3))
    scheduler.add_request(make_request("second", 3, 50, arrival_time=1.0, max_tokens=4))
    scheduler.add_request(make_request("later", 1, 90, arrival_time=2.0))  # no seq slot yet
    step(scheduler, runner, collected)
    step(scheduler, runner, collected)  # both at 5 tokens: the 4 blocks are full
    out = step(scheduler, runner, collected)
    second = scheduler.get_request("second")
    assert out.preempted_req_ids == ["second"] and out.scheduled_req_ids == ["first"]
    assert second.status is RequestStatus.PREEMPTED
    assert (second.num_computed_tokens, second.block_ids) == (0, [])
    out = step(scheduler, runner, collected)  # "first" finished last step; "second" resumes
    work = out.batch.works[0]
    assert (work.req_id, work.start_pos, work.is_sampled) == ("second", 0, True)
    assert work.token_ids == [50, 51, 52, 53, 54]
    assert collected["second"].token_ids == [53, 54, 55]


def test_no_waiting_request_is_admitted_in_a_step_that_had_to_preempt() -> None:
    scheduler = make_scheduler(block_size=2, num_kv_blocks=4)
    runner = FakeRunner(block_size=2)
    scheduler.add_request(make_request("a", 3, arrival_time=0.0))
    scheduler.add_request(make_request("b", 3, 60, arrival_time=1.0))
    step(scheduler, runner, {})
    step(scheduler, runner, {})
    scheduler.add_request(make_request("later", 1, arrival_time=2.0))
    out = step(scheduler, runner, {})  # "a" needs a block: "b" is preempted, 1 block left
    assert out.preempted_req_ids == ["b"] and out.scheduled_req_ids == ["a"]


def test_a_more_important_arrival_goes_before_less_important_decodes_which_yield_it_room() -> None:
    scheduler = make_scheduler(block_size=2, num_kv_blocks=4)
    runner = FakeRunner(block_size=2)
    scheduler.add_request(make_request("a", 3, priority=1, arrival_time=0.0))
    scheduler.add_request(make_request("b", 3, 60, priority=1, arrival_time=1.0))
    step(scheduler, runner, {})
    step(scheduler, runner, {})
    scheduler.add_request(make_request("urgent", 1, priority=0, arrival_time=2.0))
    # The urgent request takes the free block; "a"'s decode then needs one: "b" (the least
    # important, latest) is preempted for it.
    out = step(scheduler, runner, {})
    assert out.preempted_req_ids == ["b"] and out.scheduled_req_ids == ["urgent", "a"]


@pytest.mark.parametrize(
    ("priorities", "arrivals", "victim"),
    [((0, 0), (0.0, 1.0), "b"), ((1, 0), (0.0, 1.0), "a"), ((0, 1), (1.0, 0.0), "b")],
)
def test_preemption_victim_is_highest_priority_number_then_latest_arrival(
    priorities, arrivals, victim
) -> None:
    scheduler = make_scheduler(block_size=2, num_kv_blocks=4)
    runner = FakeRunner(block_size=2)
    for req_id, first_token, priority, arrival in zip("ab", (10, 60), priorities, arrivals, strict=True):
        scheduler.add_request(make_request(req_id, 3, first_token, priority=priority, arrival_time=arrival))
    step(scheduler, runner, {})
    step(scheduler, runner, {})
    assert step(scheduler, runner, {}).preempted_req_ids == [victim]


def test_important_waiting_request_preempts_less_important_one_for_a_seq_slot() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner, collected = FakeRunner(), {}
    scheduler.add_request(make_request("low", priority=5, max_tokens=6))
    step(scheduler, runner, collected)
    scheduler.add_request(make_request("high", first_token=500, priority=0, arrival_time=9.0))
    out = step(scheduler, runner, collected)
    assert out.preempted_req_ids == ["low"] and out.scheduled_req_ids == ["high"]
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, collected)
    assert collected["low"].token_ids == list(range(14, 20))


def test_important_waiting_request_preempts_less_important_one_for_blocks() -> None:
    scheduler = make_scheduler(num_kv_blocks=4)
    runner = FakeRunner()
    scheduler.add_request(make_request("low", num_prompt=12, priority=5, max_tokens=2))
    step(scheduler, runner, {})
    scheduler.add_request(make_request("high", num_prompt=8, priority=0, arrival_time=9.0))
    out = step(scheduler, runner, {})
    assert out.preempted_req_ids == ["low"] and out.scheduled_req_ids == ["high"]


def test_request_preempted_to_make_room_is_not_readmitted_in_the_same_step() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, max_num_batched_tokens=16)
    runner = FakeRunner()
    scheduler.add_request(make_request("low", num_prompt=12, priority=5))
    step(scheduler, runner, {})
    scheduler.add_request(make_request("high", priority=0, arrival_time=9.0))
    out = step(scheduler, runner, {})  # 3 blocks left would fit a chunk of "low"
    assert out.preempted_req_ids == ["low"] and out.scheduled_req_ids == ["high"]


def test_waiting_request_of_equal_priority_waits_instead_of_preempting() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner()
    scheduler.add_request(make_request("running", max_tokens=3))
    step(scheduler, runner, {})
    scheduler.add_request(make_request("newcomer", arrival_time=9.0))
    out = step(scheduler, runner, {})
    assert out.preempted_req_ids == [] and out.scheduled_req_ids == ["running"]


def test_waiting_requests_start_in_priority_then_arrival_order() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    requests = [make_request("x", priority=1, arrival_time=0.0, max_tokens=1),
                make_request("y", priority=0, arrival_time=2.0, max_tokens=1),
                make_request("z", priority=0, arrival_time=1.0, max_tokens=1)]
    _, outs = run_all(scheduler, requests)
    assert [out.scheduled_req_ids for out in outs] == [["z"], ["y"], ["x"]]


def test_abort_frees_blocks_and_is_reported_in_the_next_update() -> None:
    scheduler = make_scheduler()
    runner, collected = FakeRunner(), {}
    scheduler.add_request(make_request("r", num_prompt=9, max_tokens=50))
    step(scheduler, runner, collected)
    assert scheduler.block_manager.num_free_blocks < 1000
    scheduler.abort_request("r")
    assert scheduler.block_manager.num_free_blocks == 1000
    out = step(scheduler, runner, collected)
    assert out.batch.works == []
    assert collected["r"].finish_reason is FinishReason.ABORT
    assert not scheduler.has_unfinished_requests() and scheduler.get_request("r") is None


def test_abort_between_schedule_and_update_drops_that_steps_token() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner()
    scheduler.add_request(make_request("r"))
    out = scheduler.schedule()
    scheduler.abort_request("r")
    (output,) = scheduler.update_from_output(out, runner(out.batch))
    assert (output.new_token_ids, output.finished, output.finish_reason) == (
        [], True, FinishReason.ABORT)


def test_aborted_waiting_request_never_runs() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r"))
    scheduler.abort_request("r")
    collected, outs = run_all(scheduler, [])
    assert [out.batch.works for out in outs] == [[]]
    assert collected["r"].token_ids == [] and collected["r"].finish_reason is FinishReason.ABORT


@pytest.mark.parametrize(
    ("request_kwargs", "tokens", "text", "finish_reason", "stop_reason"),
    [
        (dict(max_tokens=3), [14, 15, 16], "opq", FinishReason.LENGTH, None),
        (dict(eos=(15,)), [14, 15], "o", FinishReason.STOP, None),
        (dict(eos=(15,), ignore_eos=True, max_tokens=3), [14, 15, 16], "opq", FinishReason.LENGTH,
         None),
        (dict(stop_token_ids=[16]), [14, 15, 16], "op", FinishReason.STOP, 16),
        (dict(stop=["pq"]), [14, 15, 16], "o", FinishReason.STOP, "pq"),
        (dict(stop=["qz"], max_tokens=3), [14, 15, 16], "opq", FinishReason.LENGTH, None),
        (dict(max_tokens=100, num_prompt=8), [18, 19], "st", FinishReason.LENGTH, None),
    ],
    ids=["max_tokens", "eos", "ignore_eos", "stop_token_id", "stop_string",
         "held_back_text_flushed_at_finish", "max_model_len"],
)
def test_stop_condition_sets_finish_reason_and_text(
    request_kwargs, tokens, text, finish_reason, stop_reason
) -> None:
    scheduler = make_scheduler(CharTokenizer(), max_model_len=10)
    collected, _ = run_all(scheduler, [make_request("r", **request_kwargs)])
    assert collected["r"].token_ids == tokens
    assert (collected["r"].text, collected["r"].finish_reason) == (text, finish_reason)
    assert collected["r"].stop_reason == stop_reason


def test_request_outgrowing_the_whole_cache_finishes_with_length() -> None:
    scheduler = make_scheduler(num_kv_blocks=2)  # 8 token slots in all
    collected, _ = run_all(scheduler, [make_request("r", num_prompt=6, max_tokens=100)])
    assert collected["r"].token_ids == [16, 17]
    assert collected["r"].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("request_kwargs", "param", "words"),
    [
        (dict(num_prompt=0), "prompt", "empty"),
        (dict(num_prompt=16), "prompt", "max_model_len"),
        (dict(num_prompt=13), "prompt", "blocks"),
        (dict(temperature=-1.0), "temperature", "temperature"),
        (dict(stop=["x"]), "stop", "tokenizer"),
    ],
)
def test_add_request_rejects_what_can_never_run(request_kwargs, param, words) -> None:
    scheduler = make_scheduler(max_model_len=16, num_kv_blocks=3)
    with pytest.raises(InvalidRequestError, match=words) as error:
        scheduler.add_request(make_request("r", **request_kwargs))
    assert error.value.param == param
    assert not scheduler.has_unfinished_requests()


def test_add_request_rejects_a_req_id_in_use() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r"))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request("r"))


def test_penalty_history_is_sent_only_with_penalties_on_sampled_works() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("plain", num_prompt=3))
    scheduler.add_request(make_request("penalized", num_prompt=9, presence_penalty=0.5))
    runner, collected = FakeRunner(), {}
    works = [w for _ in range(4) for w in step(scheduler, runner, collected).batch.works]
    for work in works:
        has_history = work.req_id == "penalized" and work.is_sampled
        assert bool(work.prompt_token_ids) == has_history
        assert work.num_output_tokens == len(work.output_token_ids) or not has_history
    penalized = [w for w in works if w.req_id == "penalized" and w.is_sampled]
    assert penalized[-1].output_token_ids == collected["penalized"].token_ids[:-1]


def test_logprobs_of_each_output_token_are_reported_and_kept() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner()
    scheduler.add_request(make_request("r", logprobs=1, max_tokens=3))
    step(scheduler, runner, {})
    out = scheduler.schedule()
    (output,) = scheduler.update_from_output(out, runner(out.batch))
    assert [(lp.token_id, lp.logprob, lp.top_logprobs) for lp in output.logprobs] == [
        (15, -0.5, [(15, -0.5)])]
    assert [lp.token_id for lp in scheduler.get_request("r").output_logprobs] == [14, 15]


def test_step_result_that_does_not_match_the_batch_raises_worker_error() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r"))
    out = scheduler.schedule()
    with pytest.raises(WorkerError):
        scheduler.update_from_output(out, StepResult(out.batch.step_id, []))


# -- prefix caching -------------------------------------------------------------------


def shared_prefix_requests(seed: int, num: int) -> list[Request]:
    """Prompts made of one of two shared prefixes (or none) and a distinct tail; mixed
    priorities, batch items among them."""
    rng = random.Random(seed)
    prefixes = [[], [rng.randrange(VOCAB) for _ in range(13)], [rng.randrange(VOCAB) for _ in range(22)]]
    requests = []
    for i in range(num):
        prompt = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        priority = rng.choice([0, 1, BATCH_PRIORITY])
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)),
                                priority, float(i)))
    return requests


@pytest.mark.parametrize("limits", [
    dict(num_kv_blocks=14, max_num_seqs=4),  # preemption forced by a tiny cache
    dict(long_prefill_chunk=3, max_num_batched_tokens=8, max_num_seqs=4),  # small chunks
])
def test_shared_prefixes_give_the_same_tokens_with_and_without_prefix_caching(limits) -> None:
    runs = {}
    for caching in (False, True):
        scheduler = make_scheduler(**limits, enable_prefix_caching=caching)
        runs[caching] = run_all(scheduler, shared_prefix_requests(3, 24), next_token_from_history)
        manager = scheduler.block_manager
        if caching:
            assert manager.prefix_cache_hits > 0 and manager.prefix_cache_queries > manager.prefix_cache_hits
    tokens = {caching: {k: v.token_ids for k, v in got.items()} for caching, (got, _) in runs.items()}
    assert tokens[True] == tokens[False]
    if "num_kv_blocks" in limits:
        assert all(sum(len(out.preempted_req_ids) for out in outs) > 0 for _, outs in runs.values())
    tokens_computed = {caching: sum(o.batch.num_tokens for o in outs) for caching, (_, outs) in runs.items()}
    assert tokens_computed[True] < tokens_computed[False]


def test_a_request_starts_after_the_prefix_an_earlier_one_computed() -> None:
    scheduler = make_scheduler(block_size=4)
    runner, collected = FakeRunner(next_token=next_token_from_history), {}
    first = Request("first", list(range(10)), SamplingParams(max_tokens=5))
    scheduler.add_request(first)
    step(scheduler, runner, collected)  # its 10 prompt tokens: blocks 0-1 full and cached
    scheduler.add_request(Request("second", list(range(8)) + [99], SamplingParams(max_tokens=2)))
    out = step(scheduler, runner, collected)
    second_work = out.batch.works[-1]
    assert (second_work.req_id, second_work.start_pos, second_work.token_ids) == ("second", 8, [99])
    assert second_work.block_ids[:2] == first.block_ids[:2]
    assert runner.num_shared_reads > 0
    outputs = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        outputs += scheduler.update_from_output(out, runner(out.batch))
    [second_end] = [o for o in outputs if o.req_id == "second" and o.finished]
    assert second_end.num_cached_tokens == 8


def test_a_failed_worker_group_takes_the_prefix_cache_with_it() -> None:
    scheduler = make_scheduler(block_size=4)
    runner, collected = FakeRunner(), {}
    scheduler.add_request(Request("a", list(range(10)), SamplingParams(max_tokens=5)))
    step(scheduler, runner, collected)
    assert scheduler.block_manager.num_cached_blocks == 2
    scheduler.preempt_all_running()
    assert scheduler.block_manager.num_cached_blocks == 0
    out = scheduler.schedule()
    assert out.batch.works[0].start_pos == 0  # recomputed from scratch


def test_a_request_whose_prefix_another_computes_in_this_step_waits_one_step_for_it() -> None:
    scheduler = make_scheduler(block_size=4)
    runner, collected = FakeRunner(), {}
    for req_id, tail in (("first", 90), ("second", 91), ("other", 92)):
        prompt = (list(range(200, 210)) if req_id != "other" else list(range(300, 310))) + [tail]
        scheduler.add_request(Request(req_id, prompt, SamplingParams(max_tokens=2)))
    out = step(scheduler, runner, collected)
    # "second" would compute the same two full blocks as "first": it waits, and in strict
    # order "other" waits behind it.
    assert out.scheduled_req_ids == ["first"]
    out = step(scheduler, runner, collected)
    starts = {work.req_id: work.start_pos for work in out.batch.works}
    assert starts == {"first": 11, "second": 8, "other": 0}


def test_works_carry_no_stop_strings_or_grammar_to_the_workers() -> None:
    """Both are the scheduler's to read; a JSON schema can be kilobytes, sent every step."""
    scheduler = make_scheduler(CharTokenizer())
    plain = make_request("plain", temperature=0.5, seed=7)
    stopping = make_request("stopping", temperature=0.5, seed=7, stop=["xyz"])
    scheduler.add_request(plain)
    scheduler.add_request(stopping)
    works = {w.req_id: w for w in scheduler.schedule().batch.works}
    assert works["plain"].sampling is plain.sampling
    assert works["stopping"].sampling.stop == [] and stopping.sampling.stop == ["xyz"]
    assert (works["stopping"].sampling.temperature, works["stopping"].sampling.seed) == (0.5, 7)
