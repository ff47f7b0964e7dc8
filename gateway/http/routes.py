"""Every route, once: the app registers them and /openapi.json describes them from this table."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web
from pydantic import BaseModel, TypeAdapter

from gateway.api.batch import batches_api, files_api
from gateway.api.embeddings.api import create_embeddings
from gateway.api.embeddings.schemas import EmbeddingRequest
from gateway.api.embeddings.shapes import EmbeddingList
from gateway.api.models import api as models_api
from gateway.api.models.shapes import LoraAdapter, ModelCard, ModelList
from gateway.api.openai import tokenize_api
from gateway.api.openai.api import chat_completions, completions
from gateway.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.api.openai.shapes import ChatCompletion, Completion, Detokenized, Tokenized
from gateway.api.ops import api as ops_api
from gateway.api.ops import status_api
from gateway.api.ops.shapes import Health, Ready
from gateway.api.requests import api as requests_api
from gateway.api.requests.shapes import RequestStatus
from gateway.api.responses import api as responses_api
from gateway.api.responses.schemas import ResponseCreate
from protocol.keys import JOB_ID_PATTERN

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQ_ID_PARAM = {"name": "req_id", "in": "path", "required": True,
                "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"}}

FILE_ID_PARAM = {"name": "file_id", "in": "path", "required": True,
                 "schema": {"type": "string", "pattern": files_api.FILE_ID_PATTERN}}
RESPONSE_ID_PARAM = {"name": "response_id", "in": "path", "required": True,
                     "schema": {"type": "string", "pattern": "^resp_[0-9a-f]{32}$"}}


def _object(*required: str) -> dict:
    return {"application/json": {"schema": {"type": "object", "required": list(required)}}}


RESPONSE_OBJECT = _object("id", "object", "status")
BATCH_ID_PARAM = {"name": "batch_id", "in": "path", "required": True,
                  "schema": {"type": "string", "pattern": JOB_ID_PATTERN}}
UPLOAD_FORM = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary"},
    "purpose": {"type": "string", "enum": list(files_api.PURPOSES)}}}


@dataclass
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    body: type[BaseModel] | tuple[str, TypeAdapter] | None = None  # a TypeAdapter comes with its name
    response: type[BaseModel] | None = None
    status: int = 200
    sse: bool = False  # answers text/event-stream (always, or when the body says stream: true)
    sse_only: bool = False
    errors: tuple[int, ...] = (400, 401, 404, 413, 429, 503)
    parameters: list[dict] = field(default_factory=list)
    form: dict | None = None  # a multipart/form-data body: its JSON schema
    content: dict | None = None  # media type -> schema, for answers no pydantic model describes


ROUTES = [
    Route("POST", "/v1/chat/completions", chat_completions, "Chat completion (SSE with stream: true)",
          ChatCompletionRequest, ChatCompletion, sse=True),
    Route("POST", "/v1/completions", completions, "Text completion (SSE with stream: true)",
          CompletionRequest, Completion, sse=True),
    Route("POST", "/v1/embeddings", create_embeddings,
          "Embeddings of texts or token ids (models served with --runner pooling)", EmbeddingRequest,
          EmbeddingList),
    Route("POST", "/tokenize", tokenize_api.tokenize, "A prompt's or a chat's token ids (vLLM's /tokenize)",
          ("TokenizeRequest", tokenize_api.TOKENIZE_BODY), Tokenized, errors=(400, 401, 404, 413)),
    Route("POST", "/detokenize", tokenize_api.detokenize, "Token ids back to text (vLLM's /detokenize)",
          tokenize_api.Detokenize, Detokenized, errors=(400, 401, 404, 413)),
    Route("GET", "/v1/models", models_api.list_models, "Models that a live scheduler serves",
          response=ModelList, errors=(401, 503)),
    Route("GET", "/v1/models/{model}", models_api.get_model, "One served model", response=ModelCard,
          errors=(401, 404, 503),
          parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
    Route("POST", "/v1/load_lora_adapter", models_api.load_lora_adapter,
          "Serve a LoRA adapter (a PEFT folder the schedulers can read) under a name (vLLM's route)",
          models_api.LoadLoraAdapter, LoraAdapter, errors=(400, 401, 404, 413)),
    Route("POST", "/v1/unload_lora_adapter", models_api.unload_lora_adapter, "Stop serving a LoRA adapter",
          models_api.UnloadLoraAdapter, LoraAdapter, errors=(400, 401, 403, 404, 413)),
    Route("POST", "/v1/requests", requests_api.submit,
          "Submit a request (202 + Location); Idempotency-Key makes retries safe",
          ("SubmitRequest", requests_api.SUBMIT), RequestStatus, status=202,
          errors=(400, 401, 404, 409, 413, 429, 503),
          parameters=[{"name": "Idempotency-Key", "in": "header", "required": False,
                       "schema": {"type": "string", "minLength": 1, "maxLength": 255}}]),
    Route("GET", "/v1/requests/{req_id}", requests_api.get_request,
          "Status, output so far, usage and timings of a submitted request", response=RequestStatus,
          errors=(401, 404, 503), parameters=[REQ_ID_PARAM]),
    Route("DELETE", "/v1/requests/{req_id}", requests_api.cancel_request, "Cancel a submitted request",
          response=RequestStatus, errors=(401, 404, 503), parameters=[REQ_ID_PARAM]),
    Route("GET", "/v1/requests/{req_id}/events", requests_api.events,
          "The request's tokens as SSE (id: <seq>); resumes after Last-Event-ID", sse=True, sse_only=True,
          errors=(400, 401, 404, 503),
          parameters=[REQ_ID_PARAM, {"name": "Last-Event-ID", "in": "header", "required": False,
                                     "schema": {"type": "string", "pattern": "^[0-9]+$"}}]),
    Route("POST", "/v1/responses", responses_api.create,
          "Create a response (Responses API; SSE with stream: true, no client needed with background: true)",
          ResponseCreate, sse=True, errors=(400, 401, 404, 413, 429, 500, 503),
          content=RESPONSE_OBJECT),
    Route("GET", "/v1/responses/{response_id}", responses_api.retrieve,
          "A stored response; with stream=true its events after starting_after (a resumed stream)", sse=True,
          errors=(400, 401, 404, 503), parameters=[
              RESPONSE_ID_PARAM,
              {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
              {"name": "starting_after", "in": "query", "required": False, "schema": {"type": "integer"}}],
          content=RESPONSE_OBJECT),
    Route("POST", "/v1/responses/{response_id}/cancel", responses_api.cancel, "Cancel a background response",
          errors=(400, 401, 404, 503), parameters=[RESPONSE_ID_PARAM],
          content=RESPONSE_OBJECT),
    Route("DELETE", "/v1/responses/{response_id}", responses_api.delete, "Delete a stored response",
          errors=(401, 404, 503), parameters=[RESPONSE_ID_PARAM],
          content=_object("id", "object", "deleted")),
    Route("GET", "/v1/responses/{response_id}/input_items", responses_api.input_items,
          "The items a response was given (its chained context first), newest first unless order=asc",
          errors=(400, 401, 404, 503), parameters=[
              RESPONSE_ID_PARAM,
              {"name": "order", "in": "query", "required": False, "schema": {"type": "string",
                                                                              "enum": ["asc", "desc"]}},
              {"name": "limit", "in": "query", "required": False,
               "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
              {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}}],
          content=_object("object", "data")),
    Route("POST", "/v1/files", files_api.upload, "Upload a batch job's input (JSONL, purpose 'batch')",
          response=files_api.FileObject, form=UPLOAD_FORM, errors=(400, 401, 413, 503)),
    Route("GET", "/v1/files", files_api.list_files, "Uploaded files, newest first",
          response=files_api.FileList, errors=(401, 503)),
    Route("GET", "/v1/files/{file_id}", files_api.retrieve, "One file's description",
          response=files_api.FileObject, errors=(401, 404, 503), parameters=[FILE_ID_PARAM]),
    Route("GET", "/v1/files/{file_id}/content", files_api.content,
          "A file's content (a finished batch's results: file-{batch}-output / -errors)",
          errors=(401, 404, 503), parameters=[FILE_ID_PARAM]),
    Route("DELETE", "/v1/files/{file_id}", files_api.delete, "Delete an uploaded file",
          response=files_api.FileDeleted, errors=(401, 404, 503), parameters=[FILE_ID_PARAM]),
    Route("POST", "/v1/batches", batches_api.create, "Create a batch job from an uploaded file",
          batches_api.BatchCreate, batches_api.BatchObject, errors=(400, 401, 404, 413, 503)),
    Route("GET", "/v1/batches", batches_api.list_batches, "Batch jobs, newest first",
          response=batches_api.BatchList, errors=(400, 401, 503),
          parameters=[{"name": "limit", "in": "query", "required": False,
                       "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                      {"name": "after", "in": "query", "required": False,
                       "schema": {"type": "string", "pattern": JOB_ID_PATTERN}}]),
    Route("GET", "/v1/batches/{batch_id}", batches_api.retrieve, "One batch job: status and request counts",
          response=batches_api.BatchObject, errors=(401, 404, 503), parameters=[BATCH_ID_PARAM]),
    Route("POST", "/v1/batches/{batch_id}/cancel", batches_api.cancel,
          "Cancel a batch job: queued lines are cancelled, unqueued ones written off",
          response=batches_api.BatchObject, errors=(401, 404, 409, 503), parameters=[BATCH_ID_PARAM]),
    Route("GET", "/health", ops_api.health, "The process is up", response=Health, errors=()),
    Route("GET", "/ready", ops_api.ready, "Redis answers and a live scheduler serves a fronted model",
          response=Ready, errors=(503,)),
    Route("GET", "/metrics", ops_api.metrics, "Prometheus metrics: the gateway's and every live scheduler's",
          errors=()),
    Route("GET", "/", status_api.status_page, "The live status page of the fleet (HTML)", errors=(),
          content={"text/html": {"schema": {"type": "string"}}}),
    Route("GET", "/fleet.json", status_api.fleet_json,
          "The fleet view (`tokenfleet status --json`): schedulers, queues, dead letters, batch jobs",
          errors=(503,), content={"application/json": {"schema": {"type": "object", "required": [
              "time", "totals", "schedulers", "queues", "dead_letters", "batch_jobs", "gateways",
              "throughput_history"]}}}),
]
