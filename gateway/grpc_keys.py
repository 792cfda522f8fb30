"""The gRPC face's key check, before a call's message is read: an interceptor that authenticates
each call of a service from its metadata and peer first, so that a call with an unknown key costs
the gateway nothing of its message (gRPC receives a unary call's message whole before its
behavior runs, and buffers what no one reads only as far as HTTP/2 flow control lets it: the
gateway's server probes no bandwidth-delay product, so that is 64 KiB). The servicer reads the
caller, or raises the check's refusal, with `caller()`."""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any, cast

import grpc

from gateway.auth import authorization_metadata
from gateway.edge import Authenticate
from gateway.tenants import TenantInfo
from reflow.errors import InvalidArgument

# grpc.aio runs each call in a task of its own, so what a call sets here is that call's alone
_CALLER: ContextVar[TenantInfo | Exception] = ContextVar("caller")


def caller() -> TenantInfo:
    """The tenant whose key the current call bears; raises what the key check raised (e.g.
    Unauthenticated). A servicer asks before it reads its request, which a refused call lacks."""
    checked = _CALLER.get()
    if isinstance(checked, Exception):
        raise checked
    return checked


def peer_address(peer: str) -> str:
    """The client's address in a gRPC peer string: `ipv4:10.0.0.7:5123` -> `10.0.0.7`,
    `ipv6:%5B::1%5D:5123` -> `::1`; another kind (`unix:...`) as it is."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return urllib.parse.unquote(rest).rpartition(":")[0].strip("[]")


class KeyCheck(grpc.aio.ServerInterceptor):
    """Authenticates every call of `service` before its request message is read. It runs outside
    the error interceptor and hands every call on to the handler that one made, a refused one
    too (whose servicer raises the refusal at `caller()`), so each is mapped and counted there.

    To run before the message is read, it takes every call as a request stream (the wire is the
    same): a unary call's one message is read from it once the key is checked."""

    def __init__(self, service: str, authenticate: Authenticate):
        self.prefix = f"/{service}/"
        self.authenticate = authenticate

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.prefix):
            return handler
        return self._gated(handler)

    def _gated(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        behavior = cast(
            Callable[..., Any],
            handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream,
        )
        streaming = handler.request_streaming

        async def admitted(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            """What `behavior` takes (the stream, or its one message), read once the key is checked;
            None for a refused call, whose refusal `caller()` raises."""
            try:
                tenant = await self.authenticate(
                    authorization_metadata(context), peer_address(context.peer())
                )
            except Exception as error:  # raised inside the error interceptor's handler, mapped there
                _CALLER.set(error)
                return requests if streaming else None
            _CALLER.set(tenant)
            if streaming:
                return requests
            async for request in requests:
                return request
            _CALLER.set(InvalidArgument("the call carries no request message; send one"))
            return None

        if handler.response_streaming:

            async def gate_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                async for response in behavior(await admitted(requests, context), context):
                    yield response

            return grpc.stream_stream_rpc_method_handler(
                gate_stream, handler.request_deserializer, handler.response_serializer
            )

        async def gate_one(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await admitted(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(
            gate_one, handler.request_deserializer, handler.response_serializer
        )
