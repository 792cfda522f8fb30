"""Authenticates calls: the bearer key of the `authorization` header (gRPC metadata or HTTP), looked
up through a two-level cache (this process, then Redis shared by every replica) in front of the
store; revocations are announced to every replica."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from math import ceil

import grpc
import redis as sync_redis
from sqlalchemy import Engine

from gateway.shared_level import OUTAGE, RedisConfig, SharedLevel, safe_url, shared_key
from gateway.tenants import TenantInfo, find_by_key
from reflow.api_keys import hash_key
from reflow.errors import Unauthenticated

logger = logging.getLogger(__name__)
# L2: apikey2:<sha256 of the key> -> the tenant, as JSON, or REVOKED. "2" since tenants say what
# their feedback trains: an entry of an older gateway lacks it, and would read as "shared"
KEY_ENTRY = "apikey2"
REVOKED = b"revoked"
REVOCATIONS = "revocations"  # the channel key hashes to forget are published on


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
    """Maps keys to tenants through two levels: L1, this process's LRU of answers (found or not)
    kept `ttl_s`; L2, the shared level in Redis (found keys only, kept REFLOW_REDIS_KEY_TTL_S);
    then the store.

    So a request costs no database round trip. A revocation announced through Redis (every
    `reflow tenants revoke` with REFLOW_REDIS_URL set) drops the key from both levels of every
    replica within moments; one that is not, or that a replica missed while Redis was down, takes
    effect within `ttl_s` on that replica (and L2's TTL where L2 still holds it).
    """

    max_entries = 10_000  # bounds memory under a flood of distinct bad keys

    def __init__(
        self,
        engine: Engine,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedLevel | None = None,
    ):
        self.engine = engine
        self.ttl_s = ttl_s
        self.clock = clock
        self.shared = shared
        # key hash -> (expiry, tenant), least recently used first
        self._cache: OrderedDict[str, tuple[float, TenantInfo | None]] = OrderedDict()
        self._listener: asyncio.Task[None] | None = None
        if shared is not None:
            shared.on_recovery.append(self._cache.clear)  # revocations may have been missed meanwhile

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
            tenant = await self._look_up(api_key, digest)
            self._cache[digest] = (now + self.ttl_s, tenant)
            self._cache.move_to_end(digest)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        if tenant is None:
            raise Unauthenticated("unknown or revoked API key; create one with `reflow tenants create`")
        return tenant

    async def _look_up(self, api_key: str, digest: str) -> TenantInfo | None:
        """L2, then the store (whose answer for a known key L2 keeps); None for an unknown key."""
        shared = self.shared if self.shared is not None and self.shared.available else None
        if shared is not None:
            try:
                entry = await shared.client.get(shared.key(KEY_ENTRY, digest))
            except OUTAGE as error:
                shared.failed(error)
                shared = None
            else:
                if entry == REVOKED:
                    return None
                if entry is not None:
                    return TenantInfo(**json.loads(entry))
        tenant = await asyncio.to_thread(find_by_key, self.engine, api_key)
        if shared is not None and tenant is not None:
            value = json.dumps(dataclasses.asdict(tenant))
            try:  # nx: never over a revocation's tombstone written since the store answered
                await shared.client.set(
                    shared.key(KEY_ENTRY, digest), value, ex=ceil(shared.config.key_ttl_s), nx=True
                )
            except OUTAGE as error:
                shared.failed(error)
        return tenant

    def start(self) -> None:
        """Listens for revocations other processes announce (with a shared level)."""
        if self.shared is not None:
            self._listener = asyncio.get_running_loop().create_task(self._listen(self.shared))

    async def _listen(self, shared: SharedLevel) -> None:
        missed = False
        while True:
            try:
                async with shared.client.pubsub() as pubsub:
                    await pubsub.subscribe(shared.key(REVOCATIONS))
                    if missed:  # revocations announced while it was not listening: forget them all
                        self._cache.clear()
                    missed = False
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:
                            self._cache.pop(message["data"].decode(), None)
            except OUTAGE as error:
                shared.failed(error)
                missed = True
                await asyncio.sleep(shared.probe_interval_s)

    async def close(self) -> None:
        """Stops listening."""
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener


def announce_key_change(config: RedisConfig | None, digest: str, *, revoked: bool) -> bool:
    """Tells every gateway sharing the Redis of `config` that the key hashed `digest` changed (its
    tenant's limits) or was revoked (L2 keeps a tombstone, so no replica caches it again); returns
    False when there is no shared level to tell, or it does not answer."""
    if config is None:
        return False
    key = shared_key(config.prefix, KEY_ENTRY, digest)
    client = sync_redis.Redis.from_url(
        config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s
    )
    try:
        with client:
            if revoked:
                client.set(key, REVOKED, ex=ceil(config.key_ttl_s))
            else:
                client.delete(key)
            client.publish(shared_key(config.prefix, REVOCATIONS), digest)
    except OUTAGE as error:
        logger.warning(
            "could not tell the gateways through Redis at %s (%s)", safe_url(config.url), type(error).__name__
        )
        return False
    return True
