"""Fair share between tenants inside one priority: which waiting request starts next.

Priorities stay strict (every request of a more important priority goes first). Inside a
priority, tenants take turns, by start-time fair queueing: each tenant's flow counts the
requests it has started; a waiting request's turn is its flow's count plus its place among
the flow's waiting requests, and the lowest turn starts first (arrival time breaks ties).
A tenant that was idle starts at the band's current turn (the turn of the request that
started last), so idleness banks no credit, and a tenant with 500 waiting requests delays
a newcomer's single request by at most one start of its own. Inside one tenant, requests
keep arrival order. Requests without a tenant form one flow of their own.
"""

from __future__ import annotations

from scheduler.request import Request

_PRUNE_ABOVE = 4096  # flows remembered before the ones that have fallen behind are forgotten


class FairShare:
    def __init__(self) -> None:
        self._started: dict[tuple[int, str | None], int] = {}  # (priority, tenant) -> turns used
        self._band_turn: dict[int, int] = {}  # priority -> turn of the request that started last

    def _first_turn(self, priority: int, tenant: str | None) -> int:
        return max(self._started.get((priority, tenant), 0), self._band_turn.get(priority, 0))

    def order(self, waiting: list[Request]) -> list[Request]:
        """The waiting requests (sorted by priority, then arrival) in the order they should start,
        as a new list (the caller removes those that start from `waiting`)."""
        first_tenant = waiting[0].tenant if waiting else None
        if all(request.tenant == first_tenant for request in waiting):
            return list(waiting)  # one flow: arrival order is already fair
        places: dict[tuple[int, str | None], int] = {}  # flow -> waiting requests of it seen so far
        keyed = []
        for request in waiting:
            flow = (request.priority, request.tenant)
            place = places.get(flow, 0)
            places[flow] = place + 1
            turn = self._first_turn(*flow) + place
            keyed.append(((request.priority, turn, request.arrival_time), request))
        keyed.sort(key=lambda item: item[0])
        return [request for _, request in keyed]

    def started(self, request: Request) -> None:
        """Count a request that left the waiting queue to run (the first of its flow's waiting)."""
        priority = request.priority
        turn = self._first_turn(priority, request.tenant)
        self._started[(priority, request.tenant)] = turn + 1
        self._band_turn[priority] = max(self._band_turn.get(priority, 0), turn)
        if len(self._started) > _PRUNE_ABOVE:
            # A flow whose count is not ahead of its band's turn starts there anyway.
            self._started = {flow: n for flow, n in self._started.items()
                             if n > self._band_turn.get(flow[0], 0)}
