"""The LoRA adapters a fleet serves, kept in Redis so that every gateway validates requests on
them and every scheduler loads them: one hash per base model, `tf:loras:{model}`, adapter name
-> its record as JSON.

Schedulers add the adapters of their `--lora-modules` at start (no owner); a gateway's
`POST /v1/load_lora_adapter` adds one (owned by the caller's tenant, if any) and
`/v1/unload_lora_adapter` removes it. A scheduler reads an adapter's record when a request on
it first comes, and serves it from its path from then on.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from protocol.messages import MessageDecodeError

# An adapter's name is a model name to clients: no spaces or slashes' surprises in keys or logs.
LORA_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
_NAME = re.compile(LORA_NAME_PATTERN)


@dataclass(frozen=True)
class LoraRecord:
    name: str
    path: str  # its PEFT folder, as the schedulers see it
    rank: int
    owner: str | None = None  # the tenant that loaded it: only it may call it; None: everyone

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, data: str | bytes) -> LoraRecord:
        try:
            raw = json.loads(data)
            record = cls(**raw)
        except (ValueError, TypeError) as exc:
            raise MessageDecodeError(f"not a LoRA adapter record: {exc}") from None
        if not isinstance(record.path, str) or not isinstance(record.rank, int):
            raise MessageDecodeError(f"not a LoRA adapter record: {raw!r}")
        return record

    def is_visible_to(self, tenant: str | None) -> bool:
        return self.owner is None or self.owner == tenant


def is_lora_name(name: str) -> bool:
    return bool(_NAME.match(name))
