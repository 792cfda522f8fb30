"""What every HTTP request passes through first: a bound on the body a route may read (feedback,
which bounds its own, excepted), and a count of requests by path and status."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import error_body
from gateway.metrics import GatewayMetrics

MAX_BODY_BYTES = 16 * 2**20  # a request body; prompts are bounded far below by REFLOW_MAX_PROMPT_CHARS
TOO_LARGE = f"the request body is over {MAX_BODY_BYTES // 2**20} MiB"
FEEDBACK = "/v1/feedback"  # reads its body itself: JSON to 32 MiB, NDJSON line by line, unbounded
PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", FEEDBACK, "/health", "/openapi.json"}


class BodyLimit:
    """Refuses (413) a body larger than MAX_BODY_BYTES, by its Content-Length or as it arrives,
    and counts requests in `reflow_gateway_http_requests`."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        path = path if path in PATHS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        status = 500  # what a request that never answers counts as

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        declared = dict(scope["headers"]).get(b"content-length", b"")
        try:
            if path == FEEDBACK:
                await self.app(scope, receive, counted)
            elif declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                await JSONResponse(error_body(413, TOO_LARGE, "invalid_argument"), 413)(
                    scope, receive, counted
                )
            else:
                await self.app(scope, _bounded(receive), counted)
        finally:
            self.metrics.http_requests.labels(path, str(status)).inc()


def _bounded(receive: Receive) -> Receive:
    """`receive`, raising 413 (in the route, whose handlers answer it) once the body passes
    MAX_BODY_BYTES."""
    seen = 0

    async def bounded() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > MAX_BODY_BYTES:
                raise HTTPException(413, TOO_LARGE)
        return message

    return bounded
