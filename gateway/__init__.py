"""The HTTP front door: OpenAI-compatible endpoints, submit-and-poll, SSE streaming.

    request ─▶ middlewares (request id, errors, API key) ─▶ handler
               validate (pydantic) ─▶ tokenize (model registry) ─▶ submit (MULTI: HSET tf:res
               queued + XADD tf:req:{model}:interactive) ─▶ follow (one pub/sub connection per
               process, routed to per-request queues; tf:res fills every gap) ─▶ JSON or SSE
"""
