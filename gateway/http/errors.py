"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status
of the ReflowError (reflow/errors.py) and, for quotas and full queues, `Retry-After`."""

from __future__ import annotations

import logging
import math

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from reflow.errors import DeadlineExceeded, InvalidArgument, ReflowError, RequestTooLarge, ResourceExhausted

logger = logging.getLogger(__name__)
CLIENT_GONE = 499  # nginx's status for a request whose client went away; nobody reads it

# The `type` OpenAI's API gives each status (its SDKs raise by status: BadRequestError, ...).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, object]:
    """The OpenAI error object for `status`."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param,
                      "code": code}}  # fmt: skip


def reflow_error_body(error: ReflowError) -> dict[str, object]:
    """The OpenAI error object of a ReflowError; `code` is its gRPC status in lower case."""
    param = error.param if isinstance(error, InvalidArgument) else None
    return error_body(error.http_status, str(error), error.code.name.lower(), param)


def error_response(error: ReflowError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The response of a request that failed with `error` (before anything was streamed)."""
    headers = dict(headers or {})
    if isinstance(error, ResourceExhausted) and not isinstance(error, RequestTooLarge):  # no use waiting
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after_ms / 1000)))
    if isinstance(error, DeadlineExceeded):  # the SDKs retry 5xx; this one would run out again
        headers["x-should-retry"] = "false"
    return JSONResponse(reflow_error_body(error), status_code=error.http_status, headers=headers)


async def on_reflow_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ReflowError)
    return error_response(error)


async def on_invalid_body(request: Request, error: Exception) -> JSONResponse:
    """A body that breaks the schema: 400 (OpenAI's status for it, not FastAPI's 422), naming the
    first field at fault."""
    assert isinstance(error, RequestValidationError)
    problems = error.errors()
    first = problems[0] if problems else {}
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = str(first.get("msg", "the request body is invalid"))
    more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return JSONResponse(
        error_body(400, f"{param}: {message}{more}" if param else message + more, "invalid_argument", param),
        status_code=400,
    )


async def on_http_error(request: Request, error: Exception) -> JSONResponse:
    """Starlette's own errors (no such path, a method the path has not) in OpenAI's shape."""
    assert isinstance(error, HTTPException)
    code = {404: "not_found", 405: "invalid_argument", 413: "invalid_argument"}.get(
        error.status_code, "error"
    )
    return JSONResponse(
        error_body(error.status_code, str(error.detail), code),
        status_code=error.status_code,
        headers=error.headers,
    )


async def on_client_gone(request: Request, error: Exception) -> Response:
    """A client that went away while its body was being read: nothing to answer, nothing to log."""
    return Response(status_code=CLIENT_GONE)


async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
    logger.error("unexpected error in %s %s", request.method, request.url.path, exc_info=error)
    return JSONResponse(
        error_body(500, f"internal error in {request.url.path}; see the gateway's logs", "internal"),
        status_code=500,
    )
