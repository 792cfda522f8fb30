"""What every HTTP request passes through before a route: a count by path and status; on a `/v1/`
route, the check of its API key before any of its body is read (401, or 429 for an address past its
unknown keys), the tenant left in the request's state; and a bound on the body a route may read
(413), by its Content-Length or as it arrives (feedback, which bounds its own, excepted)."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.edge import Authenticate
from gateway.http.errors import error_body, error_response
from gateway.metrics import GatewayMetrics
from gateway.tenants import TenantInfo
from reflow.errors import ReflowError

FEEDBACK = "/v1/feedback"  # reads its body itself: JSON whole, NDJSON line by line, each bounded
PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", FEEDBACK, "/health", "/openapi.json"}


def caller(request: Request) -> TenantInfo:
    """The tenant whose key a `/v1/` request bears, checked before its route ran."""
    tenant: TenantInfo = request.state.tenant
    return tenant


class Edge:
    """Counts requests in `reflow_gateway_http_requests`, checks the key of a request to every
    `/v1/` route with `authenticate` before its body is read, and refuses a body over
    `max_body_bytes`."""

    def __init__(
        self, app: ASGIApp, authenticate: Authenticate, metrics: GatewayMetrics, max_body_bytes: int
    ):
        self.app = app
        self.authenticate = authenticate
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        label = path if path in PATHS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        status = 500  # what a request that never answers counts as

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._admit(scope, receive, counted, keyed=label.startswith("/v1/"))
        finally:
            self.metrics.http_requests.labels(label, str(status)).inc()

    async def _admit(self, scope: Scope, receive: Receive, send: Send, keyed: bool) -> None:
        headers = Headers(scope=scope)
        if keyed:
            client = scope.get("client")
            try:
                tenant = await self.authenticate(headers.get("authorization"), client[0] if client else "")
            except ReflowError as error:
                await error_response(error)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        declared = headers.get("content-length", "")
        if scope["path"] == FEEDBACK:
            await self.app(scope, receive, send)
        elif declared.isdigit() and int(declared) > self.max_body_bytes:
            await JSONResponse(error_body(413, self._too_large(), "invalid_argument"), 413)(
                scope, receive, send
            )
        else:
            await self.app(scope, self._bounded(receive), send)

    def _bounded(self, receive: Receive) -> Receive:
        """`receive`, raising 413 (in the route, whose handlers answer it) once the body passes
        the bound."""
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        return bounded

    def _too_large(self) -> str:
        return f"the request body is over {self.max_body_bytes:,} bytes (REFLOW_MAX_REQUEST_BYTES)"
