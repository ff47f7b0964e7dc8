"""Embeddings through a real `tokenfleet up --runner pooling`, called by the clients people point
at vLLM: the openai SDK's `embeddings.create` with its defaults (base64 on the wire) and
langchain-openai's `OpenAIEmbeddings`; the vectors are the in-process engine's."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from scheduler.engine import LLMEngine
from shared.config import EngineConfig
from shared.net import free_port
from tests.fleet_helpers import TINY_CHAT, UpProcess

pytestmark = pytest.mark.slow
TEXTS = ["Redis streams carry the requests.", "A scheduler batches them.", "Paris is the capital of France."]


def _engine_vectors(model, texts: list[str]) -> list[np.ndarray]:
    config = EngineConfig(model=str(model), runner="pooling", dtype="float32", num_kv_blocks=64)
    with LLMEngine(config) as engine:
        return [r.embedding for r in engine.embed(texts)]


def _assert_same(got: list[list[float]], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for vector, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(vector, dtype=np.float32), want, rtol=1e-5, atol=1e-6)


def test_the_openai_sdk_and_langchain_against_up_with_the_pooling_runner(tiny_chat, tmp_path) -> None:
    from langchain_openai import OpenAIEmbeddings

    port = free_port()
    up = UpProcess(["--port", str(port), "--model", str(tiny_chat), "--runner", "pooling", "--num-kv-blocks",
                    "128", "--dtype", "float32"], tmp_path / "home")
    base = f"http://127.0.0.1:{port}/v1"
    try:
        up.wait_up()
        expected = _engine_vectors(tiny_chat, TEXTS)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        answer = client.embeddings.create(model=TINY_CHAT, input=TEXTS)  # encoding_format base64, decoded
        _assert_same([item.embedding for item in answer.data], expected)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)
        # langchain-openai: its token-window check tokenizes with tiktoken (OpenAI's vocabulary) and
        # sends those ids; against any other model's vocabulary it is turned off, as for vLLM.
        embeddings = OpenAIEmbeddings(model=TINY_CHAT, base_url=base, api_key="unused",
                                      check_embedding_ctx_length=False, max_retries=0)
        _assert_same(embeddings.embed_documents(TEXTS), expected)
        _assert_same([embeddings.embed_query(TEXTS[2])], expected[2:])
        # A generation route on this model names the runner.
        with pytest.raises(openai.BadRequestError, match="--runner pooling"):
            client.chat.completions.create(model=TINY_CHAT, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    finally:
        assert up.stop() == 0, up.output[-3000:]
