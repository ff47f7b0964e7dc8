"""The scheduler's side of prompt logprobs, with a fake runner that scores each named target by
its position: which prompt tokens each chunk scores, the whole list sent once with the first
token, recomputed whole after a preemption, and never started from the prefix cache."""

from __future__ import annotations

from scheduler.request import Request
from scheduler.scheduler import Scheduler, SchedulerConfig
from shared.sampling import SamplingParams
from shared.step import SampledToken, StepBatch, StepResult

PROMPT = list(range(100, 110))  # 10 tokens


def score(batch: StepBatch) -> StepResult:
    """Target k of a chunk starting at s scores prompt position s + 1 + k: logprob -(position)."""
    sampled, prompt = [], {}
    for work in batch.works:
        if work.prompt_logprob_ids:
            prompt[work.req_id] = [[tid, -float(work.start_pos + 1 + k), [[tid, -0.1]]]
                                   for k, tid in enumerate(work.prompt_logprob_ids)]
        if work.is_sampled:
            sampled.append(SampledToken(work.req_id, 7))
    return StepResult(batch.step_id, sampled, prompt)


def scheduler(budget: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, num_kv_blocks=32, block_size=4, max_num_seqs=4,
                                     max_num_batched_tokens=budget))


def run(sched: Scheduler) -> tuple[list[list[int]], dict[str, list]]:
    """The targets of every work, and the prompt logprobs each request's outputs carried."""
    targets, sent = [], {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        targets += [w.prompt_logprob_ids for w in out.batch.works]
        for output in sched.update_from_output(out, score(out.batch)):
            if output.prompt_logprobs is not None:
                assert output.req_id not in sent, "sent twice"
                sent[output.req_id] = output.prompt_logprobs
    return targets, sent


def expected() -> list:
    return [[PROMPT[0], None, None]] + [[PROMPT[p], -float(p), [[PROMPT[p], -0.1]]] for p in range(1, 10)]


def test_each_chunk_scores_the_prompt_tokens_its_rows_predict_and_all_are_sent_once():
    sched = scheduler(budget=4)
    sched.add_request(Request("r", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=1)))
    targets, sent = run(sched)
    # Chunks [0,4) [4,8) [8,10): the last chunk's last row predicts the first output token.
    assert targets[:3] == [PROMPT[1:5], PROMPT[5:9], PROMPT[9:10]]
    assert all(t == [] for t in targets[3:])  # decodes score nothing
    assert sent == {"r": expected()}


def test_a_request_preempted_midway_scores_its_prompt_again_from_the_start():
    sched = scheduler(budget=4)
    sched.add_request(Request("r", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=1)))
    out = sched.schedule()
    sched.update_from_output(out, score(out.batch))
    assert sched.preempt_all_running() == ["r"]
    targets, sent = run(sched)
    assert targets[0] == PROMPT[1:5]  # from position 0 again
    assert sent == {"r": expected()}


def test_prompt_logprobs_do_not_start_from_the_prefix_cache_but_others_still_do():
    sched = scheduler(budget=64)
    sched.add_request(Request("first", PROMPT, SamplingParams(max_tokens=1)))
    run(sched)
    sched.add_request(Request("scored", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0)))
    sched.add_request(Request("cached", PROMPT, SamplingParams(max_tokens=1)))
    out = sched.schedule()
    starts = {w.req_id: w.start_pos for w in out.batch.works}
    assert starts == {"scored": 0, "cached": 8}
    sched.update_from_output(out, score(out.batch))
