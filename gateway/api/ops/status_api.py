"""GET / (the live status page) and GET /fleet.json (the fleet view it polls, the same JSON as
`tokenfleet status --json`). The page is open (it holds no data); /fleet.json names hosts,
pids, jobs and errors, so with --api-key it needs a key, and with tenants an admin tenant's
(the auth middleware's ADMIN_PATHS; --public-metrics opens it): the page asks for that key
when /fleet.json refuses it. The page is one self-contained file
(gateway/api/ops/status_page.html): no build step, nothing fetched from elsewhere."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from gateway.api.ops.fleet_view import collect_fleet_view
from gateway.core.appkeys import REDIS
from gateway.serving.store import STORE

_PAGE = Path(__file__).with_name("status_page.html")


async def status_page(request: web.Request) -> web.Response:
    return web.Response(body=_PAGE.read_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


async def fleet_json(request: web.Request) -> web.Response:
    view = await collect_fleet_view(request.app[REDIS], request.app[STORE].keys)
    return web.json_response(view, headers={"Cache-Control": "no-store"})
