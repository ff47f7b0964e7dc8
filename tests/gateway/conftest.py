"""Fixtures of the gateway tests: an app factory on a real Redis, a fake scheduler for the
fast tests, and one real SmolLM2 scheduler shared by a module's slow tests."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from gateway.core.settings import GatewaySettings, ModelSpec
from gateway.http.app import create_app
from tests.gateway.fake_scheduler import FakeScheduler
from tokenfleet.redis_server import RedisServer

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name (its folder's name)


@pytest.fixture
def settings(redis_server, smollm2) -> GatewaySettings:
    return GatewaySettings(redis_url=redis_server.url, models=[ModelSpec.from_path(str(smollm2))], poll_s=0.5)


@pytest.fixture
def make_client(settings, aiohttp_client):
    """make_client(**overrides) -> an aiohttp test client of a gateway app."""

    async def make(**overrides):
        app = create_app(replace(settings, **overrides))
        client = await aiohttp_client(app)
        client.gateway_app = app
        return client

    return make


@pytest.fixture
def tokenizer(smollm2):
    from gateway.tokens.models import _load_tokenizer

    return _load_tokenizer(str(smollm2))


@pytest.fixture
def fake_scheduler(redis_server, tokenizer):
    with FakeScheduler(redis_server.url, MODEL, tokenizer) as fake:
        yield fake


class RealScheduler:
    """service.scheduler_service.SchedulerService on a real engine (float32, CPU), looping in a thread.
    By default SmolLM2 served as MODEL; the batch tests run it on their tiny chat model."""

    def __init__(self, url: str, folder, *, model_name: str = MODEL, scheduler_id: str = "real-1",
                 num_kv_blocks: int = 256, max_num_seqs: int = 16, max_num_batched_tokens: int = 512,
                 runner: str = "generate") -> None:
        from scheduler.engine import LLMEngine
        from service.scheduler_service import SchedulerService, ServiceSettings
        from shared.config import EngineConfig

        self.engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=num_kv_blocks,
                                             max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=max_num_batched_tokens, runner=runner))
        self.service = SchedulerService(self.engine, url, ServiceSettings(model_name, scheduler_id,
                                                                          heartbeat_s=0.5))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.service.run, args=(self.stop,), daemon=True)
        self.thread.start()
        self._wait_registered(scheduler_id)

    def _wait_registered(self, scheduler_id: str, timeout_s: float = 60.0) -> None:
        """Until the service's first heartbeat is in the registry: a gateway made before it finds no
        scheduler for the model and answers 503 (its start prepares grammars first)."""
        from protocol import registry

        deadline = time.monotonic() + timeout_s
        while scheduler_id not in registry.live_members(self.service.client, self.service.keys,
                                                        [registry.SCHEDULERS])[registry.SCHEDULERS]:
            assert self.thread.is_alive(), "the scheduler service stopped before its first heartbeat"
            assert time.monotonic() < deadline, f"no heartbeat from {scheduler_id} in {timeout_s} s"
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        self.engine.close()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def real_scheduler(module_redis, smollm2):
    scheduler = RealScheduler(module_redis.url, smollm2)
    yield scheduler
    scheduler.close()


@pytest.fixture
def real_client(module_redis, real_scheduler, smollm2, aiohttp_client):
    async def make(**overrides):
        settings = GatewaySettings(redis_url=module_redis.url, models=[ModelSpec.from_path(str(smollm2))],
                                   poll_s=0.5, **overrides)
        return await aiohttp_client(create_app(settings))

    return make
