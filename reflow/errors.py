"""Errors with their gRPC and HTTP status codes, and the one interceptor that turns them into gRPC
statuses, a request that is no message included (the HTTP face maps them in gateway/http/errors.py)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

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


class RequestTooLarge(ResourceExhausted):
    """A request carries more than one request may (e.g. feedback items); splitting it helps,
    waiting does not, hence HTTP 413 rather than a quota's 429."""

    http_status = 413


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
    """Maps ReflowError to its status and anything unexpected to INTERNAL, for reflow services; for
    every service (health and reflection too), refuses a request protobuf cannot parse as
    INVALID_ARGUMENT.

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
        if handler is None:
            return None
        handler = _refusing_undecodable(handler)  # every service's, health and reflection too
        if not handler_call_details.method.startswith("/reflow."):
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


class _Undecodable:
    """A request message protobuf could not parse, in its place until the behavior refuses it."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def tolerant(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as error:
            return _Undecodable(error)

    return tolerant


async def _refuse(context: grpc.aio.ServicerContext, request: _Undecodable) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid message ({request.error}); send the method's request message "
        "as the .proto files define it, with UTF-8 in every string field",
    )


def _refusing_undecodable(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` refusing, as INVALID_ARGUMENT, a request that is no serialization of its message
    (bad wire format, a string field that is not UTF-8): gRPC itself answers UNKNOWN, or INTERNAL
    inside a stream, with the parser's exception, and logs a traceback for every such call."""
    deserialize = handler.request_deserializer
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    generator = inspect.isasyncgenfunction(behavior)
    if deserialize is None or behavior is None or not (generator or inspect.iscoroutinefunction(behavior)):
        return handler  # bytes as they come, or a behavior grpc runs in a thread: nothing to check
    if handler.request_streaming:
        checked = _checking_stream(behavior)
    elif generator:
        checked = _checking_generator(behavior)
    else:
        checked = _checking_one(behavior)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(checked, _tolerant(deserialize), handler.response_serializer)


def _checking_one(behavior: Behavior) -> Behavior:
    """A coroutine behavior (or one that writes its stream with context.write) of one request."""

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)

    return checked


def _checking_generator(behavior: Behavior) -> Behavior:
    """An async generator behavior of one request."""

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        async for response in behavior(request, context):
            yield response

    return checked


def _checking_stream(behavior: Behavior) -> Behavior:
    """A behavior of a request stream, refusing the call at its first undecodable message."""

    async def requests(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for request in iterator:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            yield request

    if inspect.isasyncgenfunction(behavior):

        async def checked_generator(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            async for response in behavior(requests(iterator, context), context):
                yield response

        return checked_generator

    async def checked(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(requests(iterator, context), context)

    return checked


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
