"""Errors users see are data: a type, a message naming the problem, an HTTP status."""

from __future__ import annotations


class TokenfleetError(Exception):
    """Base of every error tokenfleet raises on purpose."""

    error_type = "internal_error"
    http_status = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(TokenfleetError):
    """The caller sent something we cannot run (bad parameter, prompt too long...)."""

    error_type = "invalid_request_error"
    http_status = 400


class ModelLoadError(TokenfleetError):
    """A model folder is missing, incomplete, corrupt or of an unsupported architecture."""

    error_type = "model_load_error"
    http_status = 500


class WorkerError(TokenfleetError):
    """A worker rank failed or stopped answering during a step."""

    error_type = "worker_error"
    http_status = 503


class LoraAdapterError(InvalidRequestError):
    """A LoRA adapter folder that cannot be served on this base model: missing or corrupt files,
    a rank over the limit, a target module the base lacks, another base. The message names the
    file and the problem; at a route it is a 400, at startup a load error."""
