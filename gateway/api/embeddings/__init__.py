"""`/v1/embeddings` as OpenAI defines it, served by `--runner pooling` replicas: `schemas.py` (the
body), `plan.py` (inputs -> token ids, lengths, `dimensions`, on the tokenizer thread),
`format.py` (the answer: floats or base64), `shapes.py` (its shape in /openapi.json), `api.py`
(the route: admit, queue one request per input, follow them, read their vectors),
`batch_items.py` (a Batch API `/v1/embeddings` line queued and answered: gateway/api/batch/)."""
