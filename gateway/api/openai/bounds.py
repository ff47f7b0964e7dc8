"""The bound on every list- and string-valued field of a generation request, in one place.

The schemas (gateway/api/openai/schemas.py) apply them to chat, completions, the submit-and-poll
`/v1/requests` bodies and batch lines alike; going past one is a 400 naming the field. Why they
matter: a request's lists are copied into each of its choices, written to Redis in its message,
and read by the scheduler on every token, so one unbounded body would slow every user's steps.
Where OpenAI documents a bound it is the one used, unless this server already accepted more
(stop strings: OpenAI takes 4, vLLM any number). docs/configuration.md lists them.

Free text (message contents, a prompt string) is bounded by the body's size (`--max-body-bytes`)
and then by the model's context window, not here.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 16  # `stop`: OpenAI takes 4
MAX_STOP_STRING_CHARS = 256  # each stop string (the stream holds back this much text at most)
MAX_STOP_TOKEN_IDS = 256  # `stop_token_ids` (vLLM's extra)
MAX_MESSAGES = 2048  # `messages` of one chat
MAX_CONTENT_PARTS = 256  # text parts of one message's `content`
MAX_TOOL_CALLS = 128  # an assistant message's earlier `tool_calls`
MAX_TOOLS = 128  # `tools`: OpenAI's "at most 128 functions"
MAX_SCHEMA_BYTES = 64 << 10  # a tool's `parameters`, `response_format`'s schema: compact JSON, UTF-8
MAX_N = 128  # `n`, as OpenAI; the gateway's `--max-n` (default 8) is the working cap
MAX_TOP_K = 2**31 - 1  # `top_k` (an int32 on the wire; any value past the vocabulary means no cut)
MAX_PROMPTS = 16  # prompts in one `prompt` list (of strings or of id lists)
MAX_DETOKENIZE_IDS = 1 << 18  # `tokens` of one /detokenize call: past any context window served
MAX_NAME_CHARS = 256  # `model`, `user`, a message's `name`, a tool call's `id` and `tool_call_id`
MAX_DESCRIPTION_CHARS = 16 << 10  # a tool's or a schema's `description`
