"""The OpenAI-compatible routes: chat and text completions (streamed as server-sent events or
whole), models, feedback, health, each a few lines over the InferenceService the gRPC face uses.

The key of every `/v1/` request is checked before its body is read (gateway/http/middleware.py);
a route reads the caller with `caller(request)`. A completion's first message is awaited before
the response starts, so every error before the first token (a bad key, a quota, an unknown model,
no worker) is an HTTP status with OpenAI's error body; an error after it is an `error` event in
the stream, as OpenAI's SDKs expect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from gateway.edge import EdgeLimits
from gateway.http import errors, translation
from gateway.http.choices import Choices, best
from gateway.http.feedback_body import NDJSON, feedback_items
from gateway.http.middleware import Edge, caller
from gateway.http.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    FeedbackAck,
    FeedbackItem,
    Health,
    ModelCard,
    ModelList,
)
from gateway.http.translation import ChatShape, Messages, Served, Shape, TextShape
from gateway.metrics import GatewayMetrics
from gateway.routing import ServedVersion
from gateway.service import InferenceService
from gateway.tenants import TenantInfo
from reflow.errors import NotFound, ReflowError

logger = logging.getLogger(__name__)
OWNER = "reflow"
T = TypeVar("T")

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (400, "Invalid or unsupported parameters"), (401, "No valid API key"),
        (403, "Another tenant's completion"), (404, "No such model is served"),
        (413, "The body is over REFLOW_MAX_REQUEST_BYTES"),
        (429, "A quota or the queues are full, or too many unknown keys; see Retry-After"),
        (503, "No worker can take it, or the gateway holds REFLOW_MAX_CONCURRENT_REQUESTS"),
        (504, "The latency budget ran out"),
    ]
}  # fmt: skip
TOO_MUCH_FEEDBACK = "Too many items, or a JSON body or NDJSON line over REFLOW_MAX_REQUEST_BYTES"


def _streamed(chunk_model: type[Any]) -> dict[int | str, dict[str, Any]]:
    """The 200 response of a completion route: JSON, or with `stream` an SSE stream of chunks (the
    schema of an event stream describes each event, before OpenAPI 3.2)."""
    data = {"type": "string", "description": f"{chunk_model.__name__} JSON, an error object, or [DONE]"}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {
        200: {
            "description": "The completion; with `stream`, `data:` events of chunks, then `data: [DONE]`",
            "content": {"text/event-stream": {"schema": event}},
        },
        **_ERRORS,
    }


class EventStream(StreamingResponse):
    """A server-sent event stream that closes its source however the response ends (finished, or
    the client gone), so the generation stops at the worker's next step."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str], headers: dict[str, str]):
        super().__init__(events, headers=headers | {"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()


def create_app(service: InferenceService, metrics: GatewayMetrics, limits: EdgeLimits) -> FastAPI:
    """The HTTP face's app over `service`, within `limits`."""
    app = FastAPI(
        title="reflow",
        summary="OpenAI-compatible HTTP API of a reflow gateway",
        version="1",
        docs_url=None,  # the interactive pages load scripts from a CDN; /openapi.json is the document
        redoc_url=None,
    )
    app.add_middleware(
        Edge, authenticate=service.authenticate, metrics=metrics, max_body_bytes=limits.max_request_bytes
    )
    app.add_exception_handler(ReflowError, errors.on_reflow_error)
    app.add_exception_handler(RequestValidationError, errors.on_invalid_body)
    app.add_exception_handler(HTTPException, errors.on_http_error)
    app.add_exception_handler(ClientDisconnect, errors.on_client_gone)
    app.add_exception_handler(Exception, errors.on_unexpected)

    async def complete(
        request: Request, body: ChatCompletionRequest | CompletionRequest, shape: Shape
    ) -> Response:
        received = time.perf_counter()
        asked = translation.generate_request(body)
        n, generated = translation.choice_counts(body)
        ranked, shown_logprobs = generated > n, asked.logprobs
        asked.logprobs |= ranked  # ranked by their tokens' log probabilities
        choices = Choices(service, caller(request), asked, generated, received, "best_of" if ranked else "n")
        try:  # a client that leaves while its request waits for a worker frees its place at once
            firsts = await _unless_disconnected(request, choices.begin())
        except ReflowError as error:
            return errors.error_response(error, {"x-request-id": choices.request_id})
        if firsts is None:  # cancelling the wait for them ended the streams
            return Response(status_code=errors.CLIENT_GONE)
        served = Served.of(firsts[0])
        for first in firsts:  # the inference events keep their own texts
            first.text = translation.echoed(body) + first.text
        if body.stream:  # Starlette watches for the client leaving from here on
            with_usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStream(_events(shape, served, choices, firsts, with_usage), served.headers())
        try:
            whole = await _unless_disconnected(request, _collect(choices, firsts))
        except ReflowError as error:
            return errors.error_response(error, served.headers())
        if whole is None:
            return Response(status_code=errors.CLIENT_GONE)
        shown = whole
        if ranked:  # the completion is known by its best choice's id: rating it rates the one shown
            shown = best(whole, n, keep_logprobs=shown_logprobs)
            served = replace(served, id=shown[0][0].request_id)
        completion = translation.completion(shape, served, shown, generated=whole)
        return JSONResponse(completion, headers=served.headers())

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletion, responses=_streamed(ChatCompletionChunk),
        summary="Chat completion", tags=["completions"],
    )  # fmt: skip
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        """A conversation's next assistant message, rendered with the model's chat template."""
        return await complete(request, body, ChatShape)

    @app.post(
        "/v1/completions", response_model=Completion, responses=_streamed(Completion),
        summary="Text completion", tags=["completions"],
    )  # fmt: skip
    async def completions(request: Request, body: CompletionRequest) -> Response:
        """The continuation of a prompt, as the model sees it (no chat template)."""
        return await complete(request, body, TextShape)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS, tags=["models"])
    async def list_models(request: Request) -> dict[str, Any]:
        """Every model id the workers serve now: `NAME`, `NAME/VERSION` and `NAME@ALIAS`."""
        return {"object": "list", "data": _model_cards(service, caller(request))}

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS, tags=["models"])
    async def retrieve_model(request: Request, model: str) -> dict[str, Any]:
        """One served model id."""
        for card in _model_cards(service, caller(request)):
            if card["id"] == model:
                return card
        raise NotFound(f"no worker serves model {model!r}; GET /v1/models lists what is served")

    @app.post(
        "/v1/feedback", response_model=FeedbackAck, tags=["feedback"],
        responses=_ERRORS | {413: {"model": ErrorResponse, "description": TOO_MUCH_FEEDBACK}},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"oneOf": [
                {"$ref": "#/components/schemas/FeedbackItem"},
                {"type": "array", "items": {"$ref": "#/components/schemas/FeedbackItem"}},
            ]}},
            NDJSON: {"schema": {"type": "string", "description": "One FeedbackItem JSON object per line"}},
        }}},
    )  # fmt: skip
    async def submit_feedback(request: Request) -> dict[str, Any]:
        """Ratings of and corrections to completions: one item, a JSON array of them, or NDJSON
        (read as it arrives). Items with the same `feedback_id` are stored once; each rejected
        item is listed with why. When every item is rejected, the status is the first one's. Past
        REFLOW_MAX_FEEDBACK_ITEMS items, 413 once the items before the bound were taken. A JSON
        body, and each NDJSON line, may be REFLOW_MAX_REQUEST_BYTES at most."""
        items = feedback_items(request, limits.max_request_bytes)
        result = await service.submit_feedback(caller(request), items)
        return {
            "accepted": result.accepted,
            "rejected": result.rejected,
            "errors": [
                {"index": e.index, "feedback_id": e.feedback_id, "reason": e.reason, "code": e.code}
                for e in result.errors
            ],
        }

    @app.get("/health", response_model=Health, responses={503: {"model": Health}}, tags=["health"])
    async def health() -> JSONResponse:
        """200 while a worker is ready, 503 while none is (a load balancer's probe); a draining
        gateway takes no new connections."""
        models = service.served_models()
        if not models:
            return JSONResponse({"status": "not serving", "detail": "no worker is ready"}, 503)
        served = ", ".join(name for name, _ in models)
        return JSONResponse({"status": "serving", "detail": f"serving {served}"})

    _document(app)
    return app


def _document(app: FastAPI) -> None:
    """`/openapi.json` as the routes answer: the API key as a bearer token on every `/v1` route,
    FeedbackItem among the schemas (the feedback route reads its body itself), and no 422
    (invalid bodies are 400s, in OpenAI's error shape)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            components = document["components"]
            components["schemas"]["FeedbackItem"] = FeedbackItem.model_json_schema()
            components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
            for path, operations in document["paths"].items():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
                    if path.startswith("/v1/"):
                        operation["security"] = [{"apiKey": []}]
            for name in ("HTTPValidationError", "ValidationError"):
                document["components"]["schemas"].pop(name, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _events(
    shape: Shape, served: Served, choices: Choices, firsts: Messages, with_usage: bool
) -> AsyncGenerator[str]:
    """The SSE events of a completion whose choices' first messages are `firsts`, as they come."""
    async with contextlib.aclosing(choices), contextlib.aclosing(choices.rest()) as rest:
        try:
            lasts, offsets = list(firsts), [len(first.text) for first in firsts]
            for index, first in enumerate(firsts):
                yield translation.chunk(shape, served, first, True, with_usage, index=index)
            async for index, message in rest:
                yield translation.chunk(shape, served, message, False, with_usage, offsets[index], index)
                offsets[index] += len(message.text)
                lasts[index] = message
            if with_usage:
                yield translation.usage_chunk(shape, served, lasts)
        except ReflowError as error:
            yield translation.event(errors.reflow_error_body(error))
        except Exception as error:  # never a broken stream without a word
            logger.error("request_id=%s: the stream failed", served.id, exc_info=error)
            yield translation.event(
                errors.error_body(500, "internal error; see the gateway's logs", "internal")
            )
        yield translation.DONE


async def _collect(choices: Choices, firsts: Messages) -> list[Messages]:
    """Every choice's messages, from its first."""
    whole = [[first] for first in firsts]
    async with contextlib.aclosing(choices), contextlib.aclosing(choices.rest()) as rest:
        async for index, message in rest:
            whole[index].append(message)
    return whole


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """What `work` gives; None, with `work` cancelled (and with it the generation, at the worker's
    next step), if the client goes away first: uvicorn would let it run to its end."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return None


def _model_cards(service: InferenceService, tenant: TenantInfo) -> list[dict[str, Any]]:
    """Model cards for each model served to `tenant`, its versions and its aliases."""
    cards: list[dict[str, Any]] = []
    for name, versions in service.served_models(tenant):
        aliases = sorted({alias for v in versions for alias in v.aliases})
        ready = max(v.ready_workers for v in versions)
        cards.append(_card(name, None, aliases, ready))
        for v in versions:
            cards.append(_card(f"{name}/{v.version}", name, v.aliases, v.ready_workers, v))
            cards += [_card(f"{name}@{alias}", name, [alias], v.ready_workers, v) for alias in v.aliases]
    return cards


def _card(
    id: str, parent: str | None, aliases: list[str], ready: int, served: ServedVersion | None = None
) -> dict[str, Any]:
    variants = [
        {"name": m.name, "token_agreement": m.token_agreement, "greedy_agreement": m.greedy_agreement,
         "task_score": m.task_score if m.HasField("task_score") else None}
        for m in (served.variants.values() if served else ())
    ]  # fmt: skip
    return {"id": id, "object": "model", "created": 0, "owned_by": OWNER, "parent": parent,
            "version": served.version if served else None, "aliases": aliases, "ready_workers": ready,
            "variants": variants}  # fmt: skip
