"""Schemathesis against /openapi.json: whatever a client sends, valid by the schema or not,
the gateway never answers 5xx, and what it answers matches the document."""

from __future__ import annotations

import asyncio
import threading

import pytest
import schemathesis
from aiohttp import web
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from gateway.core.settings import GatewaySettings, ModelSpec
from gateway.http.app import create_app
from gateway.http.openapi import openapi_document
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler

API_KEY = "fuzz-key"
schema = schemathesis.openapi.from_dict(openapi_document(secured=True))


class ServedGateway:
    """The app on a real port, in a thread with its own event loop (schemathesis calls it over HTTP)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(create_app(settings), handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def gateway_url(module_redis, smollm2):
    from gateway.tokens.models import _load_tokenizer

    with FakeScheduler(module_redis.url, MODEL, _load_tokenizer(str(smollm2)), max_reply_tokens=8):
        served = ServedGateway(GatewaySettings(redis_url=module_redis.url,
                                               models=[ModelSpec.from_path(str(smollm2))], poll_s=0.5,
                                               api_keys=(API_KEY,)))
        yield served.url
        served.close()


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_input_makes_a_server_error_and_answers_match_the_schema(case, gateway_url):
    # positive_data_acceptance is left out: the schema cannot say what needs the model (context
    # length, vocabulary, served names, --max-n) or ties two fields together, and those 400s are right.
    case.call_and_validate(base_url=gateway_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                           excluded_checks=[positive_data_acceptance])
