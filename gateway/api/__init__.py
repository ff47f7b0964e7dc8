"""The endpoint families, one sub-package each with its routes (`api.py`), its request bodies
(`schemas.py`), its response shapes for /openapi.json (`shapes.py`) and its serving logic:
`models/` (/v1/models, LoRA adapters), `openai/` (/v1/chat/completions, /v1/completions,
/tokenize), `requests/` (/v1/requests, submit-and-poll), `responses/` (/v1/responses), `batch/`
(/v1/files, /v1/batches and the batch ingester), `ops/` (/health, /ready, /metrics, the status
page and /fleet.json). A new family is a new sub-package here, its routes added to
gateway/http/routes.py and its layer to pyproject.toml's contract. What they share sits below
them, in gateway/serving/; a family imports only the families below it."""
