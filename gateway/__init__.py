"""The HTTP front door: OpenAI-compatible endpoints, submit-and-poll, SSE streaming.

    request ─▶ middlewares (request id, errors, API key) ─▶ handler
               validate (pydantic) ─▶ tokenize (model registry) ─▶ submit (MULTI: HSET tf:res
               queued + XADD tf:req:{model}:interactive) ─▶ follow (one pub/sub connection per
               process, its replies parsed by hiredis and routed to per-request inboxes; tf:res
               fills every gap) ─▶ JSON or SSE (per-token frames from templates, one write per batch)

`tokenfleet gateway --workers N` runs N such processes on one port (supervisor.py).
"""
