"""LoRA adapters at the gateway: a call's `model` naming an adapter, the adapters in
`/v1/models`, and vLLM's `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter`.

The adapters live in Redis (protocol/lora_registry.py), read afresh at each call that names
one (one HGET per base model), so a load or an unload through any gateway holds at once on
every gateway. An adapter a tenant loaded is that tenant's: to everyone else it does not exist
(404, as an unknown name).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable

import redis.asyncio as aioredis
from aiohttp import web
from pydantic import Field

from gateway.core.appkeys import FLEET, MODELS, REDIS, SETTINGS, STORE
from gateway.core.shapes import StrictModel
from gateway.errors import BadRequest, ModelNotFound
from gateway.serving.handlers import read_body
from gateway.tenants.access import Caller, PermissionDenied, caller
from gateway.tokens.models import ServedModel
from protocol.keys import Keys
from protocol.lora_registry import LORA_NAME_PATTERN, LoraRecord
from shared.lora_config import read_lora_config
from shared.model_config import load_model_config


class LoadLoraAdapter(StrictModel):
    lora_name: str = Field(pattern=LORA_NAME_PATTERN)
    lora_path: str = Field(min_length=1, max_length=4096)
    # Which base model it runs on; only needed when the gateway fronts several.
    base_model: str | None = Field(default=None, max_length=256)


class UnloadLoraAdapter(StrictModel):
    lora_name: str = Field(pattern=LORA_NAME_PATTERN)


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


async def _find(request: web.Request, name: str) -> tuple[ServedModel, LoraRecord] | None:
    """The base model and record of the adapter `name` that the caller may call; None: none."""
    who = caller(request)
    return await find_adapter(request.app[REDIS], request.app[STORE].keys, request.app[MODELS], name,
                              lambda record: _visible(record, who))


async def resolve_model(request: web.Request, name: str | None) -> tuple[ServedModel, str | None]:
    """A call's `model`: a fronted base model (and no adapter), or an adapter and its base."""
    models = request.app[MODELS]
    if name is None or name in models.names:
        return models.get(name), None
    found = await _find(request, name)
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


def _check_load_path(who: Caller, path: str, roots: tuple[str, ...]) -> None:
    """A tenant loads adapters only from under the gateway's --lora-root folders: the schedulers
    read the folder it names, so an unchecked path would let one tenant make them read any PEFT
    folder on their disks (and learn from the error whether a path exists). Checked on the
    resolved path, before any file is touched. Callers with no tenant, and admins, are the
    operator: they may name any folder, as --lora-modules does."""
    if who.tenant is None or who.sees_everything:
        return
    resolved = os.path.realpath(path)
    if not any(resolved == root or resolved.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
        where = (f"from under {', '.join(roots)}" if roots else
                 "at runtime on this gateway (start it with --lora-root DIR to let tenants load from DIR)")
        raise PermissionDenied(f"lora_path: a tenant may load LoRA adapters only {where}")


async def load_lora_adapter(request: web.Request) -> web.Response:
    body, _ = await read_body(request, LoadLoraAdapter)
    who = caller(request)
    _check_load_path(who, body.lora_path, request.app[SETTINGS].lora_roots)
    base = request.app[MODELS].get(body.base_model)
    fleet = request.app[FLEET]
    await fleet.refresh()
    ranks = [s.max_lora_rank for s in fleet.schedulers.values() if s.model == base.name and s.max_lora_rank]
    if not ranks:
        raise BadRequest(f"no live scheduler of {base.name!r} serves LoRA adapters "
                         "(start it with --enable-lora)", param="lora_name")
    if body.lora_name in request.app[MODELS].names:
        raise BadRequest(f"{body.lora_name!r} is the name of a base model", param="lora_name")
    # The checks that need no tensor; each scheduler reads and checks the tensors when a call needs them.
    lora = await asyncio.to_thread(  # (files: off the event loop)
        lambda: read_lora_config(body.lora_path, load_model_config(base.path), base_path=base.path,
                                 max_lora_rank=min(ranks)))
    record = LoraRecord(body.lora_name, body.lora_path, lora.rank, owner=who.tenant)
    key = request.app[STORE].keys.loras(base.name)
    if not await request.app[REDIS].hsetnx(key, body.lora_name, record.encode()):
        raise BadRequest(f"a LoRA adapter named {body.lora_name!r} is loaded already", param="lora_name")
    return web.json_response({"object": "lora_adapter", "lora_name": body.lora_name, "parent": base.name,
                              "rank": lora.rank, "owned_by": who.tenant})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body, _ = await read_body(request, UnloadLoraAdapter)
    found = await _find(request, body.lora_name)
    if found is None:
        raise ModelNotFound(f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name")
    model, record = found
    if not caller(request).can_see(record.owner):  # the operator's (--lora-modules): every tenant calls it
        raise PermissionDenied(f"the LoRA adapter {body.lora_name!r} is not yours to unload: only its "
                               "owner or an admin tenant may")
    await request.app[REDIS].hdel(request.app[STORE].keys.loras(model.name), body.lora_name)
    return web.json_response({"object": "lora_adapter", "lora_name": body.lora_name, "deleted": True})
