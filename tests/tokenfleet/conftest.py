"""The client tools (bench, batch) run against a real gateway app: the gateway tests' fixtures."""

from tests.gateway.conftest import fake_scheduler, make_client, settings, tokenizer  # noqa: F401
