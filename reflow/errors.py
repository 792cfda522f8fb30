"""Errors with their gRPC and HTTP status codes, and the one interceptor that turns them into gRPC
statuses (the HTTP face maps them in gateway/http/errors.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class ReflowError(Exception):
    """An error a caller can act on; `code` is the gRPC status it becomes, `http_status` the HTTP one."""

    code = grpc.StatusCode.INTERNAL
    http_status = 500


class InvalidArgument(ReflowError):
    """The request is malformed; fixing the request fixes it. `param` names the field at fault,
    where one is."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PermissionDenied(ReflowError):
    """The caller is known but may not touch this resource (e.g. another tenant's completion)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403


class Unauthenticated(ReflowError):
    """No valid API key."""

    code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


class NotFound(ReflowError):
    """The model or version does not exist or is not served."""

    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class FailedPrecondition(ReflowError):
    """The target is not in a state where the call makes sense (e.g. a pinned worker asked to
    follow aliases)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 400


class ResourceExhausted(ReflowError):
    """A quota or queue is full; retry later (`retry_after_ms` becomes a pushback hint)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429

    def __init__(self, message: str, retry_after_ms: int = 0):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Unavailable(ReflowError):
    """No worker can take the request now."""

    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class DeadlineExceeded(ReflowError):
    """The request's latency budget ran out."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


Behavior = Callable[..., Any]


OnDone = Callable[[str, grpc.StatusCode], None]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps ReflowError to its status and anything unexpected to INTERNAL, for reflow services.

    `on_done(method, code)`, when given, learns how every RPC of a reflow service ended.
    """

    def __init__(self, on_done: OnDone | None = None):
        self.on_done = on_done or (lambda method, code: None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/reflow."):
            return handler
        method = handler_call_details.method
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method, self.on_done),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, method, self.on_done),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _unary(handler.stream_unary, method, self.on_done),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler


# The gRPC retry-pushback header: a client with a retry policy waits this long before retrying.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    if isinstance(error, ResourceExhausted) and error.retry_after_ms:
        context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(error.retry_after_ms)),))
    if isinstance(error, ReflowError):
        await context.abort(error.code, str(error))
    logger.exception("unexpected error in %s", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see server logs")


def _code_of(error: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    if isinstance(error, ReflowError):
        return error.code
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.INTERNAL


def _unary(behavior: Behavior, method: str, on_done: OnDone) -> Behavior:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        code = grpc.StatusCode.OK
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError, asyncio.CancelledError) as error:
            code = _code_of(error, context)
            raise
        except Exception as error:
            code = _code_of(error, context)
            await _abort(context, method, error)
        finally:
            on_done(method, code)

    return wrapped


def _streaming(behavior: Behavior, method: str, on_done: OnDone) -> Behavior:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        code = grpc.StatusCode.OK
        try:
            async for response in behavior(request, context):
                yield response
        except GeneratorExit:  # the client went away while we waited to write
            code = grpc.StatusCode.CANCELLED
            raise
        except (grpc.aio.AbortError, grpc.aio.UsageError, asyncio.CancelledError) as error:
            code = _code_of(error, context)
            raise
        except Exception as error:
            code = _code_of(error, context)
            await _abort(context, method, error)
        finally:
            on_done(method, code)

    return wrapped
