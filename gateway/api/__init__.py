"""The endpoint families, one sub-package each with its routes (`api.py`), its bodies and its
serving logic: `models/` (/v1/models, LoRA adapters), `openai/` (/v1/chat/completions,
/v1/completions, /tokenize), `requests/` (/v1/requests, submit-and-poll), `responses/`
(/v1/responses), `batch/` (/v1/files, /v1/batches and the batch ingester), `ops/` (/health,
/ready, /metrics, the status page and /fleet.json). What they share sits below them, in
gateway/serving/; a family imports only the families below it (pyproject.toml's contract)."""
