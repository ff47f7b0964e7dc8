"""The HTTP front door: OpenAI-compatible endpoints, submit-and-poll, SSE streaming.

    request ─▶ middlewares (request id, errors, API key) ─▶ handler
               validate (pydantic) ─▶ tokenize (model registry) ─▶ submit (MULTI: HSET tf:res
               queued + XADD tf:req:{model}:interactive) ─▶ follow (one pub/sub connection per
               process, its replies parsed by hiredis and routed to per-request inboxes; tf:res
               fills every gap) ─▶ JSON or SSE (per-token frames from templates, one write per batch)

Its rooms, each importing only the rooms below it (pyproject.toml's import-linter contract):

    http/      the HTTP shell: app factory, route table, middlewares, /openapi.json, server,
               the supervisor of `--workers N` processes on one port
    api/       the endpoint families, one sub-package each: models/, openai/, requests/,
               responses/, batch/, ops/
    serving/   what every endpoint shares: the plan a body becomes, its trip through Redis
               (store, pub/sub, follow, records), SSE frames, the handlers' common steps
    fleet/     the fleet as the gateway sees it: live schedulers, queue depths and times,
               prefix routing (fleet/ and tokens/ share a layer: neither imports the other)
    tokens/    the fronted models: tokenizers, chat templates, a chat's token pieces
    core/      settings, metrics, background tasks, the app's shared keys, HTTP body shapes
    tenants/   who a key belongs to, its limits, what it may see
    errors.py  the errors a client sees, in OpenAI's shape
"""
