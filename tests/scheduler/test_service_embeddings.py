"""Embedding requests through the queue: a `--runner pooling` scheduler service on a real Redis.

Judged from the outside: messages queued as the gateway queues them, the tf:res records read
back (the vector as base64 float32, usage, state), the stream entries acknowledged.
"""

from __future__ import annotations

import base64
import json
import random
import uuid

import numpy as np
import pytest

from protocol.keys import CONSUMER_GROUP
from protocol.messages import RequestMessage
from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.pooling_params import PoolingParams
from testkit.checkpoints import make_tiny_bert, make_tiny_checkpoint, write_sentence_transformers_files
from tests.scheduler.service_client import KEYS, submit, token_ids, wait_terminal
from tests.scheduler.test_service import GREEDY, Running, _service

MODEL = "tiny"


def _engine(folder, runner: str = "pooling", **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=16,
                  max_num_batched_tokens=32, runner=runner)
    return LLMEngine(EngineConfig(**{**config, **overrides}), load_tokenizer_files=False)


def submit_embedding(client, prompt: list[int], *, dimensions: int | None = None, kind: str = "interactive",
                     tenant: str | None = None) -> str:
    req_id = uuid.uuid4().hex
    message = RequestMessage.make_embedding(req_id, MODEL, prompt, PoolingParams(dimensions=dimensions),
                                            kind=kind, tenant=tenant)
    if tenant is not None:
        client.sadd(KEYS.tenants(MODEL), tenant)
    client.xadd(KEYS.request_stream(MODEL, kind, tenant), {"m": message.encode()})
    return req_id


def _vector(record: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(record[b"embedding"]), dtype=np.float32)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed_service")
    bert = make_tiny_bert(root / "bert")
    write_sentence_transformers_files(bert, "mean", matryoshka_dimensions=[16, 32])
    return {"llama": make_tiny_checkpoint("llama", root / "llama"), "bert": bert}


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_embeddings_through_the_queue_equal_the_engines(folders, redis_server, family):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 70))] for _ in range(24)]
    with _engine(folders[family]) as engine:
        expected = [r.embedding for r in engine.embed(prompts)]
    client = redis_server.client()
    running = Running(_service(_engine(folders[family]), redis_server.url))
    try:
        # Interactive and batch items, a tenant's among them: all the same path.
        ids = [submit_embedding(client, p, kind="batch" if i % 3 == 0 else "interactive",
                                tenant="acme" if i % 4 == 1 else None) for i, p in enumerate(prompts)]
        records = wait_terminal(client, ids, timeout_s=120)
    finally:
        running.close()
        running.service.engine.close()
    for req_id, prompt, want in zip(ids, prompts, expected, strict=True):
        record = records[req_id]
        assert record[b"state"] == b"completed"
        np.testing.assert_allclose(_vector(record), want, rtol=1e-5, atol=1e-6)
        assert json.loads(record[b"usage"])["prompt_tokens"] == len(prompt)
        assert json.loads(record[b"usage"])["completion_tokens"] == 0
        assert token_ids(record) == []  # the placeholder token is never delivered
    for kind in ("interactive", "batch"):
        stream = KEYS.request_stream(MODEL, kind)
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0


def test_dimensions_travel_with_the_message(folders, redis_server):
    client = redis_server.client()
    running = Running(_service(_engine(folders["bert"]), redis_server.url))
    try:
        cut = submit_embedding(client, [5, 6, 7, 8], dimensions=16)
        whole = submit_embedding(client, [5, 6, 7, 8])
        refused = submit_embedding(client, [5, 6, 7, 8], dimensions=20)
        records = wait_terminal(client, [cut, whole, refused], timeout_s=60)
    finally:
        running.close()
        running.service.engine.close()
    full = _vector(records[whole])
    assert full.shape == (64,)
    np.testing.assert_allclose(_vector(records[cut]), full[:16] / np.linalg.norm(full[:16]),
                               rtol=1e-5, atol=1e-6)
    assert records[refused][b"state"] == b"failed"
    assert b"dimensions" in records[refused][b"error"]


def test_each_runner_refuses_the_other_kind_by_name(folders, redis_server):
    """A generation request on a pooling replica, an embedding request on a generating one:
    failed as the client's error, naming the runner; the service keeps serving."""
    client = redis_server.client()
    for runner in ("pooling", "generate"):
        running = Running(_service(_engine(folders["llama"], runner=runner), redis_server.url, f"s-{runner}"))
        try:
            wrong = (submit(client, MODEL, [5, 6, 7], GREEDY) if runner == "pooling"
                     else submit_embedding(client, [5, 6, 7]))
            right = (submit_embedding(client, [5, 6, 7]) if runner == "pooling"
                     else submit(client, MODEL, [5, 6, 7], GREEDY))
            records = wait_terminal(client, [wrong, right], timeout_s=60)
        finally:
            running.close()
            running.service.engine.close()
        error = json.loads(records[wrong][b"error"])
        assert records[wrong][b"state"] == b"failed"
        assert error["code"] == "invalid_request"
        assert f"--runner {runner}" in error["message"]
        assert records[right][b"state"] == b"completed"
