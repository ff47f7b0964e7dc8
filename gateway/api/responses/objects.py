"""The response object, in OpenAI's shape, rebuilt from what Redis holds: the stored spec (what
was asked) and the request's `tf:res` record (what came out). Nothing of it lives only in a
gateway, so any gateway answers for any response, and answers the same.

Output items are a function of the output text alone: with no tools in play, one assistant
message; with tools, the calls read from the text by the chat path's parser (their ids derived
from the request's id, so a rebuild gives the same ids) and the text around them as a message.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from gateway.api.openai.format import cached_tokens_of, chat_message
from gateway.serving.plan import Plan
from gateway.serving.records import ResultRecord

RESPONSE_PREFIX = "resp_"


def response_id(req_id: str) -> str:
    return RESPONSE_PREFIX + req_id


def call_id(req_id: str, index: int) -> str:
    return "call_" + hashlib.blake2b(f"{req_id}:{index}".encode(), digest_size=12).hexdigest()


@dataclass
class Outcome:
    """What the request has produced so far (a record, or what a stream has followed)."""

    state: str  # the record's: queued, running, completed, failed, cancelled, expired
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None  # the chat-shaped usage of a terminal request
    error: dict | None = None

    @classmethod
    def of_record(cls, record: ResultRecord) -> Outcome:
        return cls(record.state, record.text, record.finish_reason,
                   record.final_usage() if record.is_terminal else None, record.error)

    @property
    def is_terminal(self) -> bool:
        return self.state not in ("queued", "running")


def status_of(outcome: Outcome) -> str:
    if outcome.state == "queued":
        return "queued"
    if outcome.state == "running":
        return "in_progress"
    if outcome.state == "completed":
        return "incomplete" if outcome.finish_reason == "length" else "completed"
    if outcome.state == "cancelled":
        return "cancelled"
    return "failed"


def message_item(spec: dict, text: str, status: str) -> dict:
    return {"id": "msg_" + spec["req_id"], "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_items(spec: dict, calls: list[dict], status: str) -> list[dict]:
    return [{"id": "fc_" + call_id(spec["req_id"], k).removeprefix("call_"), "type": "function_call",
             "call_id": call_id(spec["req_id"], k), "name": call["function"]["name"],
             "arguments": call["function"]["arguments"], "status": status} for k, call in enumerate(calls)]


def split_output(spec: dict, text: str) -> tuple[str | None, list[dict]]:
    """(the message's text or None, the calls) of a finished output, as the chat path reads them."""
    if spec.get("call_format") is None:
        return text, []
    plan = Plan("chat", None, [], [], [], tool_format=spec["call_format"],  # type: ignore[arg-type]
                parallel_tool_calls=spec["parallel_calls"], is_tool_choice_forced=spec["forced"])
    message = chat_message(plan, text)
    return message.get("content"), message.get("tool_calls") or []


def output_items(spec: dict, outcome: Outcome) -> list[dict]:
    if not outcome.is_terminal:
        if spec.get("call_format") is not None or not outcome.text:
            return []  # (with tools, what the text is becomes known at its end)
        return [message_item(spec, outcome.text, "in_progress")]
    status = "completed" if status_of(outcome) == "completed" else "incomplete"
    content, calls = split_output(spec, outcome.text)
    items = [message_item(spec, content, status)] if content is not None and (content or not calls) else []
    return items + call_items(spec, calls, status)


def usage_of(outcome: Outcome) -> dict | None:
    if outcome.usage is None:
        return None
    prompt, completion = outcome.usage.get("prompt_tokens", 0), outcome.usage.get("completion_tokens", 0)
    cached = cached_tokens_of(outcome.usage)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def response_object(spec: dict, outcome: Outcome, *, status: str | None = None,
                    with_output: bool = True) -> dict:
    """The response as OpenAI answers it; `status` and no output for the snapshots of the
    stream's first events."""
    status = status or status_of(outcome)
    error = None
    if status == "failed":
        message = (outcome.error or {}).get("message", "the request failed")
        error = {"code": "server_error", "message": message}
    elif status == "cancelled" and outcome.error is not None:
        error = None  # (OpenAI's cancelled response carries no error)
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": spec["id"], "object": "response", "created_at": spec["created_at"], "status": status,
        "background": spec["background"], "error": error, "incomplete_details": incomplete,
        "instructions": spec["instructions"], "max_output_tokens": spec["max_output_tokens"],
        "max_tool_calls": None, "model": spec["model"],
        "output": output_items(spec, outcome) if with_output else [],
        "parallel_tool_calls": spec["asked_parallel"],
        "previous_response_id": spec["previous_response_id"],
        "reasoning": None, "service_tier": "default", "store": spec["store"],
        "temperature": spec["temperature"], "text": spec["text"], "tool_choice": spec["tool_choice"],
        "tools": spec["tools"], "top_p": spec["top_p"], "truncation": "disabled",
        "usage": usage_of(outcome) if with_output else None, "user": spec["user"],
        "metadata": spec["metadata"],
    }
