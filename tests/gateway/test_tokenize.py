"""/tokenize and /detokenize as vLLM serves them: the ids the fleet itself would run, behind the
same API keys as every other route (no scheduler needed: they only use the tokenizer)."""

from __future__ import annotations

import pytest

from gateway.api.openai.params import plan_chat
from gateway.api.openai.schemas import ChatCompletionRequest
from gateway.core.settings import ModelSpec
from gateway.tokens.models import ServedModel
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


async def test_tokenize_a_prompt_and_detokenize_it_back(make_client, tokenizer):
    client = await make_client()
    prompt = "The quick brown fox jumps over the lazy dog."
    response = await client.post("/tokenize", json={"model": MODEL, "prompt": prompt,
                                                    "return_token_strs": True})
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["tokens"] == tokenizer(prompt).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > body["count"]
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = await client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert (await back.json()) == {"prompt": prompt}


async def test_tokenize_a_chat_gives_the_ids_chat_completions_queues(make_client, settings, smollm2):
    client = await make_client()
    body = await (await client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})).json()
    model = ServedModel.load(ModelSpec.from_path(str(smollm2)))
    plan = plan_chat(ChatCompletionRequest(model=MODEL, messages=MESSAGES), model, settings)
    assert body["tokens"] == plan.choices[0].prompt_ids
    assert body["token_strs"] is None
    without = await (await client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES,
                                                          "add_generation_prompt": False})).json()
    assert without["count"] < body["count"]
    assert body["tokens"][:without["count"]] == without["tokens"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"model": MODEL, "messages": MESSAGES, "continue_final_message": True},
     "continue_final_message"),
    ("/detokenize", {"model": MODEL, "tokens": [10**7]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"model": MODEL, "tokens": [1] * ((1 << 18) + 1)}, "tokens"),
    ("/tokenize", {"model": MODEL, "messages": MESSAGES * 2049}, "messages"),
])
async def test_bad_tokenize_input_is_a_400_naming_the_field(make_client, path, body, param):
    client = await make_client()
    response = await client.post(path, json=body)
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param


async def test_tokenize_needs_an_api_key_like_every_route(make_client):
    client = await make_client(api_keys=("secret",))
    assert (await client.post("/tokenize", json={"model": MODEL, "prompt": "x"})).status == 401
    assert (await client.post("/detokenize", json={"model": MODEL, "tokens": [1]})).status == 401
    ok = await client.post("/tokenize", json={"model": MODEL, "prompt": "x"},
                           headers={"Authorization": "Bearer secret"})
    assert ok.status == 200
