"""Prompt logprobs through the fleet (gateway, Redis, a real scheduler on SmolLM2 in float32):
echo with logprobs in OpenAI's legacy shape (how evaluation harnesses score a prompt), echo with
max_tokens 0, vLLM's prompt_logprobs on both endpoints, streamed, through submit-and-poll, and
continuous usage on a stream."""

from __future__ import annotations

import asyncio

import openai
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM

from tests.gateway.conftest import MODEL

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

PROMPT = "The capital of France is Paris, and the capital of Italy is"
ATOL = 1e-3


@pytest_asyncio.fixture
async def sdk(real_client):
    client = await real_client()
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    sdk.http = client
    yield sdk
    await sdk.close()


@pytest.fixture(scope="module")
def reference(smollm2):
    """(prompt ids, [len - 1, vocab] log-softmax predicting each next prompt token) from transformers."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(smollm2)(PROMPT).input_ids
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, logits[:-1].log_softmax(dim=-1)


async def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(sdk, reference, tokenizer):
    ids, ref = reference
    out = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2,
                                       echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 1 and out.usage.completion_tokens == 1
    assert choice.text.startswith(PROMPT) and choice.text == PROMPT + lp.tokens[-1]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset[len(ids)] == len(PROMPT)
    for i in range(1, len(ids)):
        assert lp.tokens[i] == tokenizer.decode([ids[i]])
        assert abs(lp.token_logprobs[i] - float(ref[i - 1, ids[i]])) < ATOL, i
        best = ref[i - 1].topk(2)
        assert set(lp.top_logprobs[i]) == {tokenizer.decode([t]) for t in best.indices.tolist()}
    # The token made after the prompt: greedy, so its logprob is the best of its top.
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())

    # max_tokens 0: the prompt alone, no completion token counted.
    only = await sdk.completions.create(model=MODEL, prompt=ids, max_tokens=0, logprobs=0, echo=True)
    assert only.choices[0].text == PROMPT and only.usage.completion_tokens == 0
    assert only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(ids)],
                                                                         abs=1e-5)
    assert only.choices[0].logprobs.top_logprobs == [None] * len(ids)  # logprobs 0: no top

    # Streamed: the prompt's chunk with its logprobs first, then the completion's.
    stream = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
                                          echo=True, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text == PROMPT
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(ids)],
                                                                             abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks).startswith(choice.text)


async def test_vllm_prompt_logprobs_on_completions_and_chat(sdk, reference, tokenizer):
    ids, ref = reference
    raw = await sdk.http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                       "temperature": 0, "prompt_logprobs": 1})
    body = await raw.json()
    prompt_logprobs = body["choices"][0]["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        mine = entry[str(ids[i])]
        assert abs(mine["logprob"] - float(ref[i - 1, ids[i]])) < ATOL
        assert mine["decoded_token"] == tokenizer.decode([ids[i]])
        best = int(ref[i - 1].argmax())
        assert entry[str(best)]["rank"] == 1
    assert body["choices"][0]["logprobs"] is None  # not asked for
    chat = await sdk.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    chat_body = await chat.json()
    assert chat_body["prompt_logprobs"][0] is None
    assert len(chat_body["prompt_logprobs"]) == chat_body["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat_body["prompt_logprobs"][1:])


async def test_echo_with_logprobs_through_submit_and_poll(sdk):
    body = {"kind": "completion", "model": MODEL, "prompt": PROMPT, "max_tokens": 0, "echo": True,
            "logprobs": 1, "prompt_logprobs": 1}
    submitted = await (await sdk.http.post("/v1/requests", json=body)).json()
    for _ in range(600):
        view = await (await sdk.http.get(f"/v1/requests/{submitted['id']}")).json()
        if view["status"] == "completed":
            break
        await asyncio.sleep(0.1)
    plain = {k: v for k, v in body.items() if k != "kind"}
    direct = await (await sdk.http.post("/v1/completions", json=plain)).json()
    result = view["result"]
    assert result["choices"][0]["text"] == PROMPT == direct["choices"][0]["text"]
    assert result["choices"][0]["logprobs"]["tokens"] == direct["choices"][0]["logprobs"]["tokens"]
    assert result["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        direct["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    assert len(result["choices"][0]["prompt_logprobs"]) == len(direct["choices"][0]["prompt_logprobs"])
    assert result["usage"]["completion_tokens"] == 0


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(sdk):
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    assert counts[-2] == 8  # the last content chunk already counts every token
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
