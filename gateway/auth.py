"""Authenticates calls: the bearer key of the `authorization` header (gRPC metadata or HTTP), looked
up through a two-level cache (this process, then Redis shared by every replica, its values signed)
in front of the store, with unknown keys throttled per client address; revocations are announced
to every replica."""

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
from typing import Generic, NoReturn, TypeVar

import grpc
import redis as sync_redis
from sqlalchemy import Engine

from gateway.failed_keys import FailedKeys
from gateway.shared_level import OUTAGE, RedisConfig, SharedLevel, safe_url, shared_key, trouble
from gateway.signed_values import SECRET_NAME, Signer
from gateway.tenants import TenantInfo, find_by_key
from reflow.api_keys import hash_key
from reflow.errors import Unauthenticated
from reflow.store.secrets import shared_secret

logger = logging.getLogger(__name__)
# L2: apikey3:<sha256 of the key> -> the tenant as signed JSON (gateway/signed_values.py), or
# REVOKED. "3" since values are signed: an older gateway's entry would read as forged, and it
# could not read this one
KEY_ENTRY = "apikey3"
REVOKED = b"revoked"  # unsigned: it only keeps replicas from caching the key again, never refuses it
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


V = TypeVar("V")


class KeyCache(Generic[V]):
    """Answers by key hash, each kept `ttl_s`, the least recently used dropped past `max_entries`."""

    def __init__(self, ttl_s: float, max_entries: int):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()  # digest -> (expiry, answer)

    def get(self, digest: str, now: float) -> tuple[V, bool] | None:
        """The answer for `digest` and whether it is fresh; None if there is none. An expired answer
        stays until it is replaced or dropped: what it said is still a hint."""
        entry = self._entries.get(digest)
        if entry is None:
            return None
        self._entries.move_to_end(digest)
        return entry[1], entry[0] > now

    def put(self, digest: str, answer: V, now: float) -> None:
        self._entries[digest] = (now + self.ttl_s, answer)
        self._entries.move_to_end(digest)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def pop(self, digest: str) -> None:
        self._entries.pop(digest, None)

    def clear(self) -> None:
        self._entries.clear()


class Authenticator:
    """Maps keys to tenants through two levels: L1, this process's LRU of found keys kept `ttl_s`
    (and, apart, of unknown ones, so that no number of bad keys evicts a tenant); L2, the shared
    level in Redis (found keys only, signed, kept REFLOW_REDIS_KEY_TTL_S); then the store.

    So a request costs no database round trip. A revocation announced through Redis (every
    `reflow tenants revoke` with REFLOW_REDIS_URL set) drops the key from both levels of every
    replica within moments; one that is not, or that a replica missed while Redis was down, takes
    effect within `ttl_s` on that replica (and L2's TTL where L2 still holds it).

    A client address that presented `failures_per_minute` unknown keys within a minute gets
    ResourceExhausted, without a lookup, for any key L1 has not known valid, until the minute
    ends: a tenant behind the same address as a key scanner keeps its service.
    """

    max_entries = 10_000  # of each of L1's two caches

    def __init__(
        self,
        db: Engine,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedLevel | None = None,
        failures_per_minute: int = 60,
    ):
        self.db = db
        self.clock = clock
        self.shared = shared
        self.signer = None if shared is None else Signer(shared_secret(db, SECRET_NAME))
        self.failures = FailedKeys(failures_per_minute, clock)
        self._known: KeyCache[TenantInfo] = KeyCache(ttl_s, self.max_entries)
        self._unknown: KeyCache[None] = KeyCache(ttl_s, self.max_entries)
        self._listener: asyncio.Task[None] | None = None
        if shared is not None:
            shared.on_recovery.append(self._known.clear)  # revocations may have been missed meanwhile

    async def authenticate(self, authorization: str | None, client: str = "") -> TenantInfo:
        """The tenant whose key `authorization` (the header's value) bears; Unauthenticated for a
        missing, unknown or revoked key, ResourceExhausted while `client` (the caller's address)
        is past its unknown keys."""
        api_key = bearer_key(authorization)
        digest = hash_key(api_key)
        now = self.clock()
        known = self._known.get(digest, now)
        if known is not None and known[1]:
            return known[0]
        if known is None:  # a key L1 never knew valid: past the limit, no lookup
            self.failures.check(client)
            if (unknown := self._unknown.get(digest, now)) is not None and unknown[1]:
                self._refuse(digest, client, now)
        tenant = await self._look_up(api_key, digest)
        if tenant is None:
            self._refuse(digest, client, now)
        self._unknown.pop(digest)
        self._known.put(digest, tenant, now)
        return tenant

    def _refuse(self, digest: str, client: str, now: float) -> NoReturn:
        self._known.pop(digest)
        self._unknown.put(digest, None, now)
        self.failures.failed(client)
        raise Unauthenticated("unknown or revoked API key; create one with `reflow tenants create`")

    async def _look_up(self, api_key: str, digest: str) -> TenantInfo | None:
        """L2 (a value a gateway signed), then the store, whose answer for a known key L2 keeps; None
        for an unknown or revoked key."""
        shared, signer = self.shared, self.signer
        if shared is None or signer is None or not shared.available:
            return await asyncio.to_thread(find_by_key, self.db, api_key)
        key = shared.key(KEY_ENTRY, digest)
        try:
            entry = await shared.client.get(key)
        except OUTAGE as error:
            shared.failed(error)
            return await asyncio.to_thread(find_by_key, self.db, api_key)
        if isinstance(entry, bytes) and entry != REVOKED and (value := signer.open(key, entry)) is not None:
            return TenantInfo(**json.loads(value))
        tenant = await asyncio.to_thread(find_by_key, self.db, api_key)
        if tenant is not None:
            signed = signer.sign(key, json.dumps(dataclasses.asdict(tenant)).encode())
            try:  # nx: never over a revocation's tombstone written since the store answered
                await shared.client.set(key, signed, ex=ceil(shared.config.key_ttl_s), nx=True)
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
                        self._known.clear()
                    missed = False
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:  # a key revoked, changed or made: ask again
                            self._known.pop(message["data"].decode())
                            self._unknown.pop(message["data"].decode())
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
            "could not tell the gateways through Redis: Redis at %s %s", safe_url(config.url), trouble(error)
        )
        return False
    return True
