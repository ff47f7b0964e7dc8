"""A request's prompt logprobs, from the scheduler's side: which prompt tokens each prefill chunk
scores, gathering the workers' answers chunk by chunk, and sending them once.

The workers score a chunk's rows from its own logits (workers/prompt_logprobs.py). A request that
asks for them computes its whole prompt (scheduler.py does not start it from the prefix cache:
cached positions have no logits), and one preempted midway computes it again from the start, its
entries replaced as the chunks come back.
"""

from __future__ import annotations

from scheduler.request import Request
from shared.errors import WorkerError
from shared.step import SequenceWork, StepResult


def prompt_logprob_targets(request: Request, start: int, end: int) -> list[int]:
    """The prompt tokens that the chunk computing positions [start, end) scores: position p
    predicts token p + 1, up to the prompt's last token (whose own logits are sampled)."""
    if request.sampling.prompt_logprobs is None or request.is_prompt_logprobs_sent:
        return []
    num_prompt = request.num_prompt_tokens
    if start >= num_prompt - 1:
        return []
    return request.prompt_token_ids[start + 1:min(end + 1, num_prompt)]


def take_prompt_logprobs(request: Request, work: SequenceWork, result: StepResult) -> None:
    """Keep what the workers scored for this work's chunk (entries from its start position on)."""
    entries = result.prompt_logprobs.get(work.req_id)
    if entries is None or len(entries) != len(work.prompt_logprob_ids):
        raise WorkerError(f"step {result.step_id}: {len(entries or [])} prompt logprobs for "
                          f"{work.req_id!r}, which asked for {len(work.prompt_logprob_ids)}")
    if len(request.prompt_logprobs) < work.start_pos:
        raise WorkerError(f"step {result.step_id}: prompt logprobs of {work.req_id!r} from position "
                          f"{work.start_pos}, but only {len(request.prompt_logprobs)} are known")
    del request.prompt_logprobs[work.start_pos:]
    request.prompt_logprobs += entries


def prompt_logprobs_to_send(request: Request) -> list[list] | None:
    """The whole prompt's logprobs, once (with the request's first output token): the first
    prompt token has no logprob; None when not asked for or already sent."""
    if request.sampling.prompt_logprobs is None or request.is_prompt_logprobs_sent:
        return None
    if len(request.prompt_logprobs) != request.num_prompt_tokens - 1:
        raise WorkerError(f"{request.req_id!r}: {len(request.prompt_logprobs)} prompt logprobs for a prompt "
                          f"of {request.num_prompt_tokens} tokens")
    request.is_prompt_logprobs_sent = True
    entries = [[request.prompt_token_ids[0], None, None], *request.prompt_logprobs]
    request.prompt_logprobs = []
    return entries
