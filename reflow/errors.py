"""Errors with their gRPC status code, and the one interceptor that turns them into statuses."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class ReflowError(Exception):
    """An error a caller can act on; `code` is the gRPC status it becomes."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(ReflowError):
    """The request is malformed; fixing the request fixes it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(ReflowError):
    """No valid API key."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ReflowError):
    """The key is valid but may not touch this resource."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(ReflowError):
    """The model or version does not exist or is not served."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ReflowError):
    """A quota or queue is full; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ReflowError):
    """No worker can take the request now."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ReflowError):
    """The request's latency budget ran out."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


Behavior = Callable[..., Any]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps ReflowError to its status and anything unexpected to INTERNAL, for reflow services."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith("/reflow."):
            return handler
        method = handler_call_details.method
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _unary(handler.stream_unary, method),
                handler.request_deserializer,
                handler.response_serializer,
            )
        return handler


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    if isinstance(error, ReflowError):
        await context.abort(error.code, str(error))
    logger.exception("unexpected error in %s", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see server logs")


def _unary(behavior: Behavior, method: str) -> Behavior:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as error:
            await _abort(context, method, error)

    return wrapped


def _streaming(behavior: Behavior, method: str) -> Behavior:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except (grpc.aio.AbortError, grpc.aio.UsageError):
            raise
        except Exception as error:
            await _abort(context, method, error)

    return wrapped
