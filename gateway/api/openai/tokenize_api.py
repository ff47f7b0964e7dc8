"""POST /tokenize and /detokenize, as vLLM serves them: clients that count tokens on the server
(load generators, context-window checks) get the ids the fleet itself would run.

/tokenize takes a prompt ({model, prompt, add_special_tokens}) or a chat ({model, messages,
add_generation_prompt, tools}) and answers {count, max_model_len, tokens, token_strs}; the chat's
ids are those /v1/chat/completions would queue (the same template and tool rendering).
/detokenize takes {model, tokens} and answers {prompt}. Both run on the tokenizer thread.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from aiohttp import web
from pydantic import Field, TypeAdapter

from gateway.api.openai import bounds
from gateway.api.openai.params import message_dicts
from gateway.api.openai.schemas import ChatMessage, Tool
from gateway.api.openai.tools import prompt_messages
from gateway.core.shapes import StrictModel
from gateway.serving.handlers import read_body
from gateway.tokens.models import MODELS, ServedModel
from gateway.tokens.tokenize_pool import TOKENIZE
from shared.tokenizer import encode_ids


class TokenizePrompt(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(StrictModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=bounds.MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: Literal[False] = Field(False, description="only false")
    add_special_tokens: bool = False  # the template writes the special tokens itself
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(None, max_length=bounds.MAX_TOOLS)


# For /openapi.json; a body is read as a chat when it has messages, else as a prompt.
TOKENIZE_BODY = TypeAdapter(TokenizeChat | TokenizePrompt)


class Detokenize(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=bounds.MAX_DETOKENIZE_IDS)


def _token_ids(body: TokenizeChat | TokenizePrompt, model: ServedModel) -> list[int]:
    if isinstance(body, TokenizePrompt):
        return encode_ids(model.tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)
    tools = [tool.model_dump() for tool in body.tools] if body.tools else None
    messages, template_tools = prompt_messages(message_dicts(body), tools, model.chat_template)
    text, ids = model.encode_chat(messages, tools=template_tools,
                                  add_generation_prompt=body.add_generation_prompt)
    return encode_ids(model.tokenizer, text, add_special_tokens=True) if body.add_special_tokens else ids


def _tokenized(body: TokenizeChat | TokenizePrompt, model: ServedModel) -> dict:
    ids = _token_ids(body, model)
    return {"count": len(ids), "max_model_len": model.context_window, "tokens": ids,
            "token_strs": model.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}


def _is_chat(raw: bytes) -> bool:
    try:
        data = json.loads(raw)
    except ValueError:
        return False  # read_body says what is wrong with it
    return isinstance(data, dict) and "messages" in data


async def tokenize(request: web.Request) -> web.Response:
    body, _ = await read_body(request, TokenizeChat if _is_chat(await request.read()) else TokenizePrompt)
    model = request.app[MODELS].get(body.model)
    return web.json_response(await request.app[TOKENIZE].run(_tokenized, body, model))


def _detokenized(body: Detokenize, model: ServedModel) -> dict:
    ids = model.check_token_ids(body.tokens, param="tokens") if body.tokens else []
    return {"prompt": model.decode(ids)}


async def detokenize(request: web.Request) -> web.Response:
    body, _ = await read_body(request, Detokenize)
    model = request.app[MODELS].get(body.model)
    return web.json_response(await request.app[TOKENIZE].run(_detokenized, body, model))
