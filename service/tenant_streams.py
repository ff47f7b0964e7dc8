"""The request streams of one model: its plain stream per kind, and one per tenant.

A stream's consumer group hands out entries in order only, so one stream shared by every
tenant would put a newcomer's request behind another tenant's whole backlog. The gateway
queues each tenant's requests in a stream of their own (protocol.keys.request_stream) and
adds the tenant to the model's tenant set; schedulers learn the set as they admit. Each of
these streams is split by partition (protocol/keys.py): a scheduler reads every partition's.
"""

from __future__ import annotations

import re

from protocol.keys import REQUEST_KINDS, TENANT_PATTERN, Keys

_TENANT = re.compile(TENANT_PATTERN)


class TenantStreams:
    def __init__(self, keys: Keys, model: str) -> None:
        self.keys = keys
        self.model = model
        self._tenants: set[str] = set()
        self._by_kind: dict[str, list[str]] = {kind: keys.request_streams(model, kind)
                                               for kind in REQUEST_KINDS}

    def of(self, kind: str) -> list[str]:
        return self._by_kind[kind]

    def all(self) -> list[str]:
        """Interactive streams first, then batch ones."""
        return [stream for kind in REQUEST_KINDS for stream in self._by_kind[kind]]

    def learn(self, members: set[bytes] | set[str]) -> list[str]:
        """Add the streams of tenants not seen before (from the model's tenant set); returns them."""
        added: list[str] = []
        for member in members:
            tenant = member.decode() if isinstance(member, bytes) else member
            if tenant in self._tenants or not _TENANT.match(tenant):
                continue  # known, or not a name the gateway would have written
            self._tenants.add(tenant)
            for kind in REQUEST_KINDS:
                streams = self.keys.request_streams(self.model, kind, tenant)
                self._by_kind[kind] += streams
                added += streams
        return added
