"""LoRA adapters at the gateway: a call's `model` naming an adapter (resolve_model), and the
adapters a caller may call, listed on `/v1/models` (the routes, load and unload among them, are
api.py's).

The adapters live in Redis (protocol/lora_registry.py), read afresh at each call that names
one (one HGET per base model), so a load or an unload through any gateway holds at once on
every gateway. An adapter a tenant loaded is that tenant's: to everyone else it does not exist
(404, as an unknown name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import redis.asyncio as aioredis
from aiohttp import web

from gateway.core.appkeys import REDIS
from gateway.errors import ModelNotFound
from gateway.serving.store import STORE
from gateway.tenants.access import Caller, caller
from gateway.tokens.models import MODELS, ServedModel
from protocol.keys import Keys
from protocol.lora_registry import LoraRecord


def _visible(record: LoraRecord, who: Caller) -> bool:
    return record.owner is None or who.can_see(record.owner)


async def find_adapter(client: aioredis.Redis, keys: Keys, models: Iterable[ServedModel], name: str,
                       may_call: Callable[[LoraRecord], bool]) -> tuple[ServedModel, LoraRecord] | None:
    """The base model and record of the adapter `name`, if `may_call` it; None: none."""
    for model in models:
        data = await client.hget(keys.loras(model.name), name)
        if data is not None:
            record = LoraRecord.decode(data)
            return (model, record) if may_call(record) else None
    return None


async def find_visible(request: web.Request, name: str) -> tuple[ServedModel, LoraRecord] | None:
    """The base model and record of the adapter `name` that the caller may call; None: none."""
    who = caller(request)
    return await find_adapter(request.app[REDIS], request.app[STORE].keys, request.app[MODELS], name,
                              lambda record: _visible(record, who))


async def resolve_model(request: web.Request, name: str | None) -> tuple[ServedModel, str | None]:
    """A call's `model`: a fronted base model (and no adapter), or an adapter and its base."""
    models = request.app[MODELS]
    if name is None or name in models.names:
        return models.get(name), None
    found = await find_visible(request, name)
    if found is None:
        raise ModelNotFound(f"the model {name!r} does not exist (served: {', '.join(models.names)}, "
                            "and the LoRA adapters in /v1/models)", param="model")
    return found[0], name


async def adapter_cards(request: web.Request, served: set[str]) -> list[dict]:
    """/v1/models' entries for the adapters the caller may call on the served base models."""
    keys, client, who = request.app[STORE].keys, request.app[REDIS], caller(request)
    cards = []
    for model in request.app[MODELS]:
        if model.name not in served:
            continue
        for _, data in sorted((await client.hgetall(keys.loras(model.name))).items()):
            record = LoraRecord.decode(data)
            if _visible(record, who):
                cards.append({"id": record.name, "object": "model", "created": model.created,
                              "owned_by": record.owner or "tokenfleet", "max_model_len": model.context_window,
                              "root": record.path, "parent": model.name})
    return cards
