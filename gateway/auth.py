"""Authenticates calls: the bearer key of the `authorization` header (gRPC metadata or HTTP), looked
up in the store through a short TTL cache."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

import grpc
from sqlalchemy import Engine

from gateway.tenants import TenantInfo, find_by_key
from reflow.api_keys import hash_key
from reflow.errors import Unauthenticated


def authorization_metadata(context: grpc.aio.ServicerContext) -> str | None:
    """The `authorization` metadata entry of a gRPC call, if it has a text one."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):  # binary (`-bin`) values never are
            return value
    return None


def bearer_key(authorization: str | None) -> str:
    """The API key in an `authorization: Bearer <key>` header; Unauthenticated when absent or
    malformed."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    raise Unauthenticated("send your API key as the header `authorization: Bearer <key>`")


class Authenticator:
    """Maps keys to tenants; a key's answer (found or not) is reused for `ttl_s` seconds.

    So a request costs no database round trip, and a revoked key stops working within `ttl_s`.
    """

    max_entries = 10_000  # bounds memory under a flood of distinct bad keys

    def __init__(self, engine: Engine, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.ttl_s = ttl_s
        self.clock = clock
        # key hash -> (expiry, tenant), least recently used first
        self._cache: OrderedDict[str, tuple[float, TenantInfo | None]] = OrderedDict()

    async def authenticate(self, authorization: str | None) -> TenantInfo:
        """The tenant whose key `authorization` (the header's value) bears; Unauthenticated for a
        missing, unknown or revoked key."""
        api_key = bearer_key(authorization)
        digest = hash_key(api_key)
        now = self.clock()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            self._cache.move_to_end(digest)
            tenant = cached[1]
        else:
            tenant = await asyncio.to_thread(find_by_key, self.engine, api_key)
            self._cache[digest] = (now + self.ttl_s, tenant)
            self._cache.move_to_end(digest)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        if tenant is None:
            raise Unauthenticated("unknown or revoked API key; create one with `reflow tenants create`")
        return tenant
