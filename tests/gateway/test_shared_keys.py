"""The two-level key cache in a real Redis: each Authenticator here is one gateway replica's. A
lookup goes L1 → L2 → store; a revocation announced through Redis reaches every replica at once;
an outage leaves L1 and the store serving, and a replica back on Redis forgets what it may have
missed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine

from gateway.auth import REVOCATIONS, Authenticator, announce_key_change
from gateway.shared_level import shared_key
from gateway.tenants import TenantInfo, create_tenant, revoke_tenant
from reflow.api_keys import hash_key
from reflow.errors import Unauthenticated
from reflow.store.database import migrate, open_engine
from tests.support.redis import RedisServer, SharedRedis
from tests.support.waiting import eventually


@pytest.fixture
def engine(tmp_path: Path) -> Engine:
    engine = open_engine(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(engine)
    return engine


@contextlib.asynccontextmanager
async def replicas(
    engine: Engine, shared: SharedRedis, n: int = 2, ttl_s: float = 60
) -> AsyncIterator[list[Authenticator]]:
    """`n` replicas' key caches over one store and one Redis, listening for revocations."""
    auths = [Authenticator(engine, ttl_s, shared=shared.level()) for _ in range(n)]
    for auth in auths:
        auth.start()
    await eventually(lambda: _listening(shared) == n, what=f"{n} replicas listening for revocations")
    try:
        yield auths
    finally:
        for auth in auths:
            await auth.close()
            assert auth.shared is not None
            await auth.shared.close()


async def test_a_key_one_replica_looked_up_is_found_in_l2_by_the_next(
    engine: Engine, shared_redis: SharedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    info, key = create_tenant(engine, "acme")
    async with replicas(engine, shared_redis) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == info  # from the store, now in L2
        lookups = []
        monkeypatch.setattr("gateway.auth.find_by_key", lambda *args: lookups.append(args))
        assert await b.authenticate(f"Bearer {key}") == info and lookups == []  # L2, not the store
        with pytest.raises(Unauthenticated):  # an unknown key is never in L2: the store says so
            await b.authenticate("Bearer no-such-key-0123456789")
        assert len(lookups) == 1


def _listening(shared: SharedRedis) -> int:
    """How many replicas are subscribed to the revocations channel."""
    with redis.Redis.from_url(shared.url) as client:
        ((_, count),) = client.pubsub_numsub(shared_key(shared.prefix, REVOCATIONS))
    return int(count)


async def test_a_revocation_through_one_replica_is_refused_by_the_other_long_before_its_cache_expires(
    engine: Engine, shared_redis: SharedRedis
) -> None:
    info, key = create_tenant(engine, "acme")
    async with replicas(engine, shared_redis) as (a, b):
        for auth in (a, b):
            assert await auth.authenticate(f"Bearer {key}") == info  # in both L1s, and in L2
        digest = revoke_tenant(engine, "acme")
        assert digest is not None
        assert await asyncio.to_thread(announce_key_change, shared_redis.config, digest, revoked=True)

        async def refused(auth: Authenticator) -> bool:
            try:
                await auth.authenticate(f"Bearer {key}")
            except Unauthenticated:
                return True
            return False

        for auth in (b, a):  # L1 would hold it for 60 s: the announcement did it
            await eventually(lambda auth=auth: refused(auth), timeout_s=30, what="the revocation")
        # and no replica puts it back in L2 from a store read made before the revocation
        late = Authenticator(engine, 60, shared=shared_redis.level())
        with pytest.raises(Unauthenticated):
            await late.authenticate(f"Bearer {key}")
        assert late.shared is not None
        await late.shared.close()


async def test_changed_limits_reach_the_replicas_when_announced(
    engine: Engine, shared_redis: SharedRedis
) -> None:
    info, key = create_tenant(engine, "acme")
    async with replicas(engine, shared_redis) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == await b.authenticate(f"Bearer {key}") == info
        with engine.begin() as connection:
            connection.exec_driver_sql("UPDATE tenants SET tokens_per_minute = 1000")
        assert announce_key_change(shared_redis.config, hash_key(key), revoked=False)
        expected = dataclasses.replace(info, tokens_per_minute=1000)
        for auth in (a, b):
            await eventually(  # L1 would hold the old ones for 60 s: the announcement did it
                lambda auth=auth: _authenticated(auth, key, expected), timeout_s=30, what="the new limits"
            )


async def _authenticated(auth: Authenticator, key: str, expected: TenantInfo) -> bool:
    return await auth.authenticate(f"Bearer {key}") == expected


async def test_through_an_outage_l1_and_the_store_serve_and_a_replica_back_on_redis_forgets_what_it_missed(
    engine: Engine, redis_server: RedisServer
) -> None:
    info, key = create_tenant(engine, "acme")
    _, other_key = create_tenant(engine, "globex")
    async with replicas(engine, redis_server.shared) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == info
        redis_server.stop()
        assert (await a.authenticate(f"Bearer {other_key}")).name == "globex"  # the store, L2 down
        assert (await b.authenticate(f"Bearer {key}")).name == "acme"
        # revoked while Redis is down: the announcement cannot be made, and b's L1 holds the key
        digest = revoke_tenant(engine, "acme")
        assert digest is not None and not announce_key_change(
            redis_server.shared.config, digest, revoked=True
        )
        assert (await b.authenticate(f"Bearer {key}")).name == "acme"  # until its L1 TTL (60 s here)
        redis_server.start()
        await eventually(lambda: b.shared is not None and b.shared.available, timeout_s=5, what="Redis back")
        with pytest.raises(Unauthenticated):  # back on Redis, it forgot its L1: the store answers
            await b.authenticate(f"Bearer {key}")
