"""Chat templates and tokenizers run on the gateway's tokenizing thread, never on the event loop
(on the loop, tokenizing stalled every stream a gateway process held)."""

from __future__ import annotations

import threading

import pytest

from gateway.tokens.models import ServedModel
from gateway.tokens.tokenize_pool import THREAD_NAME
from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.asyncio


@pytest.fixture
def tokenizing_threads(monkeypatch) -> list[str]:
    """The name of the thread of each encode_chat / encode_text call."""
    names: list[str] = []
    for name in ("encode_chat", "encode_text"):
        original = getattr(ServedModel, name)

        def recording(self, *args, _original=original, **kwargs):
            names.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(ServedModel, name, recording)
    return names


async def test_every_route_that_tokenizes_does_it_off_the_event_loop(make_client, fake_scheduler,
                                                                     tokenizing_threads):
    client = await make_client()
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path, body in (("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
                       ("/v1/requests", {**chat, "kind": "chat"})):
        response = await client.post(path, json=body)
        assert response.status in (200, 202), await response.text()
        await response.read()
    assert len(tokenizing_threads) == 4
    assert all(name.startswith(THREAD_NAME) for name in tokenizing_threads), tokenizing_threads
    assert threading.current_thread().name not in tokenizing_threads  # the loop's own


async def test_a_bad_prompt_found_while_tokenizing_is_still_a_clear_400(make_client, fake_scheduler):
    client = await make_client()
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 4})
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "prompt"
