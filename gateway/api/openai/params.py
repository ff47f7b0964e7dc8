"""A validated body -> what to queue: one (prompt ids, SamplingParams) per choice.

The rules that need the model live here: the chat template, prompt length against the
context window, token ids against the vocabulary, n and the number of prompts against the
gateway's caps, one seed per choice (the seed itself for choice 0, a hash of seed and index for
the others) so that n > 1 with a seed gives n different, repeatable choices, and a bound on the
length of grammar-constrained answers.
"""

from __future__ import annotations

import hashlib

from gateway.api.openai.chat_tools import chat_grammar, chat_tools
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.api.openai.tools import prompt_messages
from gateway.core.settings import GatewaySettings
from gateway.errors import BadRequest
from gateway.serving.plan import ChoicePlan, Plan
from gateway.tokens.models import ServedModel
from shared.sampling import SamplingParams

# max_tokens of a grammar-constrained answer (response_format, a forced tool choice) when the
# client gives none: a grammar can leave a small model a loop (a string it never closes) that
# would otherwise run to the end of the context window. docs/structured-outputs.md says so.
DEFAULT_CONSTRAINED_MAX_TOKENS = 1024


def _choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 keeps the seed; choice i > 0 gets a stable hash of (seed, i), so that choice i of
    seed s is not choice 0 of seed s + i (as seed + i made it)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)  # an int64, as the wire expects


def _check_n(body: SamplingFields, settings: GatewaySettings) -> None:
    if body.n > settings.max_n:
        raise BadRequest(f"n must be at most {settings.max_n} on this server, got {body.n}", param="n")


def _check_length(model: ServedModel, num_prompt: int, max_tokens: int | None, *, prompt_param: str,
                  max_param: str, default: int | None = None) -> int:
    """max_tokens (when None: `default`, or the rest of the context, whichever is less), after
    checking prompt + output fits."""
    window = model.context_window
    if num_prompt >= window:
        raise BadRequest(f"this model's maximum context length is {window} tokens; the prompt has "
                         f"{num_prompt} tokens", param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return min(window - num_prompt, default or window)
    if num_prompt + max_tokens > window:
        raise BadRequest(f"this model's maximum context length is {window} tokens; you asked for "
                         f"{num_prompt + max_tokens} ({num_prompt} in the prompt, {max_tokens} to "
                         f"generate)", param=max_param, code="context_length_exceeded")
    return max_tokens


def _sampling(body: SamplingFields, max_tokens: int, logprobs: int | None,
              seed: int | None, stop_token_ids: list[int], prompt_logprobs: int | None) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=top_k,
        min_p=body.min_p or 0.0,
        seed=seed,
        stop=body.stop_strings,
        stop_token_ids=stop_token_ids,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logprobs=logprobs,
        ignore_eos=body.ignore_eos,
        prompt_logprobs=prompt_logprobs,
    ).validate()


def _choices(body: SamplingFields, prompts: list[list[int]], max_tokens: list[int],
             logprobs: int | None, prompt_logprobs: int | None) -> list[ChoicePlan]:
    choices = []
    stop_token_ids = list(body.stop_token_ids or [])  # (one list for all choices: none changes it)
    for p, ids in enumerate(prompts):
        for i in range(body.n):
            index = p * body.n + i
            sampling = _sampling(body, max_tokens[p], logprobs, _choice_seed(body.seed, i), stop_token_ids,
                                 prompt_logprobs)
            choices.append(ChoicePlan(index, p, ids, sampling))
    return choices


def plan_chat(body: ChatCompletionRequest, model: ServedModel, settings: GatewaySettings) -> Plan:
    _check_n(body, settings)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise BadRequest("give max_completion_tokens or max_tokens, not both", param="max_tokens")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    tools = chat_tools(body, model)
    grammar = chat_grammar(body, tools)
    messages, template_tools = prompt_messages(message_dicts(body), tools.definitions, model.chat_template)
    text, ids = model.encode_chat(messages, tools=template_tools)
    max_tokens = _check_length(model, len(ids), body.max_completion_tokens or body.max_tokens,
                               prompt_param="messages", max_param=max_param,
                               default=DEFAULT_CONSTRAINED_MAX_TOKENS if grammar is not None else None)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    choices = _choices(body, [ids], [max_tokens], logprobs, body.prompt_logprobs)
    for choice in choices:
        choice.sampling.grammar = grammar
    return Plan(
        "chat", model, choices, [text], [len(ids)],
        priority=body.priority, stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=logprobs, tool_format=tools.format, parallel_tool_calls=tools.is_parallel,
        is_tool_choice_forced=tools.forced_names is not None,
        max_tokens_given=(body.max_completion_tokens or body.max_tokens) is not None,
        prompt_logprobs=body.prompt_logprobs, continuous_usage=_continuous_usage(body),
    )


def _continuous_usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


def message_dicts(body: ChatCompletionRequest) -> list[dict]:
    messages = []
    for message in body.messages:
        entry: dict = {"role": message.role, "content": message.text}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return messages


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def plan_completion(body: CompletionRequest, model: ServedModel, settings: GatewaySettings) -> Plan:
    _check_n(body, settings)
    prompts = _prompt_list(body.prompt)
    if not prompts:
        raise BadRequest("the prompt is empty", param="prompt")
    is_prompt_only = body.echo and body.max_tokens == 0
    # One token is made and dropped: it costs no forward of its own (the prefill's last row).
    requested_max_tokens = 1 if is_prompt_only else body.max_tokens
    prompt_ids, texts, max_tokens = [], [], []
    for p, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
        if isinstance(prompt, str):
            ids = model.encode_text(prompt, param=param) if prompt else model.check_token_ids([], param=param)
            text = prompt
        else:
            ids = model.check_token_ids(list(prompt), param=param)
            text = model.decode(ids) if body.echo else ""
        max_tokens.append(_check_length(model, len(ids), requested_max_tokens, prompt_param=param,
                                        max_param="max_tokens"))
        prompt_ids.append(ids)
        texts.append(text)
    # The workers score the prompt for vLLM's prompt_logprobs, and for echo with logprobs (the
    # prompt's tokens lead the choice's logprobs); top N: the larger of the two asked for.
    wanted = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    return Plan(
        "completion", model,
        _choices(body, prompt_ids, max_tokens, body.logprobs, max(wanted) if wanted else None), texts,
        [len(ids) for ids in prompt_ids], priority=body.priority, stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        logprobs=body.logprobs, echo=body.echo, is_prompt_only=is_prompt_only,
        prompt_logprobs=body.prompt_logprobs, continuous_usage=_continuous_usage(body),
    )
