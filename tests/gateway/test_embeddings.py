"""/v1/embeddings through a real gateway, Redis and `--runner pooling` schedulers (tiny models on
the CPU): the openai SDK with its defaults (base64), every input form, `dimensions`, lengths,
the runner refusals, bad bodies. Vectors are judged equal to the engine's own in process."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import openai
import pytest
import pytest_asyncio
import redis

from gateway.core.settings import GatewaySettings, ModelSpec
from gateway.http.app import create_app
from protocol.keys import Keys
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from testkit.checkpoints import (
    add_tiny_wordpiece_tokenizer,
    make_tiny_bert,
    tiny_llama_with_smollm2_tokenizer,
    write_sentence_transformers_files,
)
from tests.gateway.batch_fleet import read_outputs, wait_for_job
from tests.gateway.conftest import RealScheduler

pytestmark = pytest.mark.asyncio

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings for search", "hello"]


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2) -> dict[str, str]:
    root = tmp_path_factory.mktemp("embedding_models")
    embedder = tiny_llama_with_smollm2_tokenizer(root / "embedder", smollm2, max_position_embeddings=256)
    chat = tiny_llama_with_smollm2_tokenizer(root / "chat", smollm2, with_stop_ids=True)
    bert = make_tiny_bert(root / "bert")
    add_tiny_wordpiece_tokenizer(bert)
    write_sentence_transformers_files(bert, "mean", matryoshka_dimensions=[16, 32])
    return {"embedder": str(embedder), "chat": str(chat), "bert": str(bert)}


@pytest.fixture(scope="module")
def fleet(module_redis, models):
    schedulers = [
        RealScheduler(
            module_redis.url,
            models["embedder"],
            model_name="embedder",
            scheduler_id="e1",
            runner="pooling",
            max_num_batched_tokens=64,
        ),
        RealScheduler(
            module_redis.url, models["bert"], model_name="bert", scheduler_id="b1", runner="pooling"
        ),
        RealScheduler(module_redis.url, models["chat"], model_name="chat", scheduler_id="c1"),
    ]
    yield schedulers
    for scheduler in schedulers:
        scheduler.close()


@pytest.fixture
def make_gateway(module_redis, models, fleet, aiohttp_client):
    async def make(**overrides):
        specs = [ModelSpec(path, name) for name, path in models.items()]
        settings = GatewaySettings(redis_url=module_redis.url, models=specs, poll_s=0.5, **overrides)
        return await aiohttp_client(create_app(settings))

    return make


@pytest_asyncio.fixture
async def client(make_gateway):
    return await make_gateway()


@pytest_asyncio.fixture
async def sdk(client):
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    yield sdk
    await sdk.close()


def _in_process(folder: str, prompts, **kwargs) -> list[np.ndarray]:
    with LLMEngine(EngineConfig(model=folder, runner="pooling", dtype="float32", num_kv_blocks=64)) as engine:
        return [r.embedding for r in engine.embed(prompts, **kwargs)]


async def test_the_openai_sdk_with_its_defaults_gets_the_engines_vectors(sdk, models, module_redis):
    answer = await sdk.embeddings.create(model="embedder", input=TEXTS)  # base64 on the wire
    expected = _in_process(models["embedder"], TEXTS)
    assert [item.index for item in answer.data] == [0, 1, 2]
    for item, want in zip(answer.data, expected, strict=True):
        np.testing.assert_allclose(np.asarray(item.embedding, dtype=np.float32), want, rtol=1e-5, atol=1e-6)
    assert answer.model == "embedder"
    # Answered: the requests' records (kilobytes of vector each) are deleted, not kept for a day.
    raw = await sdk.embeddings.with_raw_response.create(model="embedder", input=TEXTS)
    req_ids = raw.headers["tokenfleet-request-id"].split(",")
    plain = redis.Redis.from_url(module_redis.url)
    for _ in range(100):
        if not any(plain.exists(Keys().result(r)) for r in req_ids):
            break
        await asyncio.sleep(0.05)
    assert len(req_ids) == 3 and not any(plain.exists(Keys().result(r)) for r in req_ids)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0


async def test_every_input_form_and_both_encodings(client, models):
    ids = [[5, 600, 7000, 12], [42] * 30]
    expected = _in_process(models["embedder"], ids)
    for body_input, want in ((ids, expected), (ids[0], expected[:1])):
        response = await client.post(
            "/v1/embeddings", json={"model": "embedder", "input": body_input, "user": "someone"}
        )
        assert response.status == 200, await response.text()
        answer = await response.json()
        assert answer["object"] == "list" and answer["usage"]["prompt_tokens"] == sum(
            map(len, ids[: len(want)])
        )
        for item, vector in zip(answer["data"], want, strict=True):
            assert item["object"] == "embedding"
            np.testing.assert_allclose(
                np.asarray(item["embedding"], dtype=np.float32), vector, rtol=1e-5, atol=1e-6
            )
    response = await client.post(
        "/v1/embeddings", json={"model": "bert", "input": "hello world", "encoding_format": "base64"}
    )
    answer = await response.json()
    vector = np.frombuffer(base64.b64decode(answer["data"][0]["embedding"]), dtype=np.float32)
    np.testing.assert_allclose(vector, _in_process(models["bert"], ["hello world"])[0], rtol=1e-5, atol=1e-6)


async def test_dimensions_only_where_the_model_declares_matryoshka_sizes(client, models):
    response = await client.post("/v1/embeddings", json={"model": "bert", "input": "hello", "dimensions": 16})
    assert response.status == 200
    [item] = (await response.json())["data"]
    np.testing.assert_allclose(
        item["embedding"], _in_process(models["bert"], ["hello"], dimensions=16)[0], rtol=1e-5, atol=1e-6
    )
    for model, dimensions, words in (
        ("embedder", 16, "Matryoshka"),
        ("bert", 20, "not one this model declares"),
    ):
        response = await client.post(
            "/v1/embeddings", json={"model": model, "input": "hi", "dimensions": dimensions}
        )
        error = (await response.json())["error"]
        assert response.status == 400 and error["param"] == "dimensions" and words in error["message"]


async def test_an_input_past_the_model_is_a_400_or_cut_where_asked(client, models):
    long_ids = list(range(100, 400))  # the embedder's window is 256
    response = await client.post("/v1/embeddings", json={"model": "embedder", "input": long_ids})
    error = (await response.json())["error"]
    assert (
        response.status == 400
        and error["code"] == "context_length_exceeded"
        and "300 tokens" in error["message"]
    )
    response = await client.post(
        "/v1/embeddings", json={"model": "embedder", "input": long_ids, "truncate_prompt_tokens": 50}
    )
    answer = await response.json()
    assert response.status == 200 and answer["usage"]["prompt_tokens"] == 50
    np.testing.assert_allclose(
        answer["data"][0]["embedding"],
        _in_process(models["embedder"], [long_ids[-50:]])[0],
        rtol=1e-5,
        atol=1e-6,
    )


async def test_each_route_refuses_a_model_of_the_other_runner_by_name(client):
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "embedder", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    error = (await response.json())["error"]
    assert response.status == 400 and "--runner pooling" in error["message"] and error["param"] == "model"
    response = await client.post("/v1/completions", json={"model": "bert", "prompt": "hi", "max_tokens": 4})
    assert response.status == 400 and "--runner pooling" in (await response.json())["error"]["message"]
    response = await client.post("/v1/embeddings", json={"model": "chat", "input": "hi"})
    error = (await response.json())["error"]
    assert response.status == 400 and "--runner generate" in error["message"] and error["param"] == "model"
    response = await client.post(
        "/v1/chat/completions",
        json={"model": "chat", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status == 200  # the chat model still chats


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["fine", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, 2, 10**9]}, "input"),
        ({"input": [-1, 2]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "normalize": False}, "normalize"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": 5}, "input"),
    ],
)
async def test_bad_bodies_are_400s_naming_the_field(client, body, param):
    response = await client.post("/v1/embeddings", json={"model": "embedder", **body})
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["param"] is not None and error["param"].startswith(param), error


def _embedding_lines(num: int) -> tuple[list[str], list[list[int]]]:
    """`/v1/embeddings` lines of one input each (token ids), the last one refused (out of vocabulary)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, size=int(rng.integers(1, 60))).tolist() for _ in range(num)]
    lines = [
        json.dumps(
            {
                "custom_id": f"chunk-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "embedder", "input": p, "encoding_format": "base64"},
            }
        )
        for i, p in enumerate(prompts)
    ]
    lines.append(
        json.dumps(
            {
                "custom_id": "bad",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "embedder", "input": [10**9]},
            }
        )
    )
    return lines, prompts


def _check_outputs(outputs: list[dict], prompts: list[list[int]], folder: str) -> None:
    expected = _in_process(folder, prompts)
    by_id = {o["custom_id"]: o for o in outputs}
    assert len(by_id) == len(outputs) == len(prompts) + 1  # every line once
    for i, want in enumerate(expected):
        body = by_id[f"chunk-{i}"]["response"]["body"]
        assert by_id[f"chunk-{i}"]["response"]["status_code"] == 200
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] == len(prompts[i])
        vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype=np.float32)
        np.testing.assert_allclose(vector, want, rtol=1e-5, atol=1e-6)
    refused = by_id["bad"]["response"]
    assert refused["status_code"] == 400 and "vocabulary" in refused["body"]["error"]["message"]


async def test_a_batch_job_of_embedding_lines_from_a_plain_redis_client(client, module_redis, models):
    lines, prompts = _embedding_lines(40)
    plain = redis.Redis.from_url(module_redis.url)
    plain.xadd("tf:batch:in", {"job_id": "embed-plain", "lines": "\n".join(lines)})
    job = await asyncio.to_thread(wait_for_job, plain, "embed-plain", timeout_s=120)
    assert job["status"] == "completed", job
    assert (int(job["completed"]), int(job["failed"])) == (40, 1)
    _check_outputs([o["line"] for o in read_outputs(plain, "embed-plain")], prompts, models["embedder"])


async def test_a_batch_job_of_embedding_lines_through_the_openai_sdk(sdk, models):
    lines, prompts = _embedding_lines(25)
    uploaded = await sdk.files.create(file=("chunks.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = await sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.3)
        batch = await sdk.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    good = (await sdk.files.content(batch.output_file_id)).text.splitlines()
    bad = (await sdk.files.content(batch.error_file_id)).text.splitlines()
    _check_outputs([json.loads(line) for line in good + bad], prompts, models["embedder"])


async def test_submit_and_poll_an_embedding(client, models, module_redis):
    response = await client.post(
        "/v1/requests", json={"kind": "embedding", "model": "embedder", "input": TEXTS[0]}
    )
    assert response.status == 202, await response.text()
    req_id = (await response.json())["id"]
    for _ in range(200):
        view = await (await client.get(f"/v1/requests/{req_id}")).json()
        if view["status"] not in ("queued", "running"):
            break
        await asyncio.sleep(0.05)
    assert view["status"] == "completed" and view["kind"] == "embedding"
    assert redis.Redis.from_url(module_redis.url).exists(Keys().result(req_id))  # polled ids stay
    result = view["result"]
    assert result["object"] == "list" and result["usage"]["prompt_tokens"] == view["usage"]["prompt_tokens"]
    np.testing.assert_allclose(
        result["data"][0]["embedding"], _in_process(models["embedder"], TEXTS[:1])[0], rtol=1e-5, atol=1e-6
    )
    for body, param in (({"input": ["a", "b"]}, "input"), ({"input": "a", "model": "chat"}, "model")):
        response = await client.post("/v1/requests", json={"kind": "embedding", "model": "embedder", **body})
        assert response.status == 400 and (await response.json())["error"]["param"] == param
    response = await client.post(
        "/v1/requests", json={"kind": "completion", "model": "embedder", "prompt": "hi", "max_tokens": 2}
    )
    assert response.status == 400 and "--runner pooling" in (await response.json())["error"]["message"]


async def test_tenants_limits_and_isolation_apply_to_embeddings(make_gateway):
    from tests.gateway.test_tenants import auth, tenants

    client = await make_gateway(tenants=tenants(tokens_per_minute=100))
    body = {"model": "embedder", "input": list(range(100, 160))}  # 60 prompt tokens, no output tokens
    first = await client.post("/v1/embeddings", json=body, headers=auth("key-a"))
    assert first.status == 200
    second = await client.post("/v1/embeddings", json=body, headers=auth("key-a"))
    assert second.status == 429 and (await second.json())["error"]["code"] == "tokens_per_minute"
    assert (await client.post("/v1/embeddings", json=body, headers=auth("key-b"))).status == 200
    submitted = await client.post(
        "/v1/requests", json={"kind": "embedding", **body, "input": [5, 6]}, headers=auth("key-b")
    )
    req_id = (await submitted.json())["id"]
    assert (await client.get(f"/v1/requests/{req_id}", headers=auth("key-a"))).status == 404  # not its own
    assert (await client.get(f"/v1/requests/{req_id}", headers=auth("key-b"))).status == 200
