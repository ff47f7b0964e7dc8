"""Batch jobs: OpenAI Batch lines in and out, a job's state in Redis, the ingester that feeds
lines to the schedulers and collects their outputs, and /v1/files and /v1/batches."""
