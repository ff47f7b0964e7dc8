"""GET /v1/models (the fronted models a live scheduler serves, and the LoRA adapters the caller
may call on them) and vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

import asyncio
import os

from aiohttp import web
from pydantic import Field

from gateway.api.models.adapters import adapter_cards, find_visible, resolve_model
from gateway.core.appkeys import REDIS, SETTINGS
from gateway.core.shapes import StrictModel
from gateway.errors import BadRequest, ModelNotFound, NotFound
from gateway.fleet.tracker import FLEET
from gateway.serving.handlers import read_body
from gateway.serving.store import STORE
from gateway.tenants.access import Caller, PermissionDenied, caller
from gateway.tokens.models import MODELS, ServedModel
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


def _card(model: ServedModel) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "tokenfleet",
            "max_model_len": model.context_window}


async def list_models(request: web.Request) -> web.Response:
    """The fronted models that a live scheduler serves now."""
    fleet = request.app[FLEET]
    await fleet.refresh()
    served = set(fleet.served_models)
    cards = [_card(m) for m in request.app[MODELS] if m.name in served]
    cards += await adapter_cards(request, served)  # each with its base as `parent`
    return web.json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    model, lora_name = await resolve_model(request, name)
    fleet = request.app[FLEET]
    await fleet.refresh()
    if not fleet.is_served(model.name):
        raise NotFound(f"no live scheduler serves the model {name!r}", param="model", code="model_not_found")
    if lora_name is not None:
        cards = await adapter_cards(request, {model.name})
        return web.json_response(next(c for c in cards if c["id"] == name))
    return web.json_response(_card(model))


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
    found = await find_visible(request, body.lora_name)
    if found is None:
        raise ModelNotFound(f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name")
    model, record = found
    if not caller(request).can_see(record.owner):  # the operator's (--lora-modules): every tenant calls it
        raise PermissionDenied(f"the LoRA adapter {body.lora_name!r} is not yours to unload: only its "
                               "owner or an admin tenant may")
    await request.app[REDIS].hdel(request.app[STORE].keys.loras(model.name), body.lora_name)
    return web.json_response({"object": "lora_adapter", "lora_name": body.lora_name, "deleted": True})
