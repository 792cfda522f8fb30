"""Quotas shared by gateway replicas in a real Redis: each SharedQuotas here is one replica's, on
a connection of its own. Streams, requests and tokens per minute hold across them; a dead
replica's streams come back with their leases; an outage falls back to per-replica limits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import pytest

from gateway.quotas import LocalQuotas, QuotaExceeded
from gateway.shared_quotas import SharedQuotas
from gateway.tenants import TenantInfo
from tests.support.redis import RedisServer, SharedRedis
from tests.support.waiting import eventually


def refills(refusal: QuotaExceeded, full_ms: int, started: float) -> bool:
    """Whether the refusal's retry-after is `full_ms` less the refill since `started` (at most what
    the test took since then, however slow the machine). Redis's clock reads whole milliseconds, so
    the refill it saw may be up to one more than the time that passed."""
    waited_ms = (time.monotonic() - started) * 1000
    return full_ms - waited_ms - 1 <= refusal.retry_after_ms <= full_ms


@contextlib.asynccontextmanager
async def replicas(
    shared: SharedRedis, n: int = 2, lease_s: float = 15.0
) -> AsyncIterator[list[SharedQuotas]]:
    """`n` replicas' quotas on one Redis."""
    quotas = [SharedQuotas(shared.level(), lease_s, LocalQuotas()) for _ in range(n)]
    try:
        yield quotas
    finally:
        for q in quotas:
            await q.close()
            await q.shared.close()


async def refused(quotas: SharedQuotas, tenant: TenantInfo, tokens: int = 0) -> QuotaExceeded:
    """The refusal of one more call."""
    with pytest.raises(QuotaExceeded) as refusal:
        async with quotas.admit(tenant, tokens):
            pass
    return refusal.value


async def test_replicas_share_a_tenants_streams_and_an_ended_one_lets_the_next_in(
    shared_redis: SharedRedis,
) -> None:
    tenant = TenantInfo(1, "acme", max_concurrent_streams=4, requests_per_minute=0)
    async with replicas(shared_redis) as (a, b), contextlib.AsyncExitStack() as open_streams:
        for quotas in (a, a, b, b):
            await open_streams.enter_async_context(quotas.admit(tenant))
        for quotas in (a, b):  # the fifth, on either replica
            assert (await refused(quotas, tenant)).quota == "streams"
        other = TenantInfo(2, "other", max_concurrent_streams=4, requests_per_minute=0)
        async with b.admit(other):  # another tenant's count is its own
            pass
        await open_streams.aclose()  # the four end
        async with a.admit(tenant), b.admit(tenant):
            pass


async def test_requests_per_minute_hold_across_replicas(shared_redis: SharedRedis) -> None:
    tenant = TenantInfo(1, "acme", max_concurrent_streams=0, requests_per_minute=3)
    async with replicas(shared_redis) as (a, b):
        started = time.monotonic()
        for quotas in (a, b, a):
            async with quotas.admit(tenant):
                pass
        refusal = await refused(b, tenant)
        assert refusal.quota == "requests_per_minute" and refills(refusal, 20_000, started)  # 1 in 20 s
        assert "3 requests per minute; retry in" in str(refusal)


async def test_tokens_per_minute_hold_across_replicas_and_settle_to_what_was_used(
    shared_redis: SharedRedis,
) -> None:
    tenant = TenantInfo(1, "acme", max_concurrent_streams=0, requests_per_minute=0, tokens_per_minute=600)
    async with replicas(shared_redis) as (a, b):
        started = time.monotonic()
        async with a.admit(tenant, 400) as charge:  # 200 of 600 left while it runs
            refusal = await refused(b, tenant, 300)
            # 100 short at 10 tokens a second
            assert refusal.quota == "tokens_per_minute" and refills(refusal, 10_000, started)
            assert "600 tokens per minute (this request reserves 300" in str(refusal)
            charge.tokens = 100  # what the stream turned out to use: 300 come back
        async with b.admit(tenant, 300) as charge:  # 500 left now
            charge.tokens = 300
        async with a.admit(tenant, 150):  # nothing charged (no token was sent): 200 stay
            pass
        async with b.admit(tenant, 200) as charge:
            charge.tokens = 200
        assert (await refused(a, tenant, 10)).quota == "tokens_per_minute"  # ~0 left
        # a request reserving more than a minute's worth runs once the bucket is full, in debt
        big = TenantInfo(2, "big", max_concurrent_streams=0, requests_per_minute=0, tokens_per_minute=60)
        started = time.monotonic()
        async with a.admit(big, 100) as charge:
            charge.tokens = 100
        refusal = await refused(b, big, 1)
        assert refills(refusal, 41_000, started)  # 40 in debt, 1 token a second


async def test_a_dead_replicas_streams_come_back_with_their_leases_and_a_live_one_renews_them(
    shared_redis: SharedRedis,
) -> None:
    tenant = TenantInfo(1, "acme", max_concurrent_streams=1, requests_per_minute=0)
    async with replicas(shared_redis, lease_s=0.6) as (a, b):
        async with a.admit(tenant):
            await asyncio.sleep(1.5)  # two and a half leases: renewed all along
            await refused(b, tenant)
        dying = SharedQuotas(shared_redis.level(), 0.6, LocalQuotas())
        await dying.take(tenant, 0)  # a slot it will never give back: its process dies
        await dying.close()
        await dying.shared.close()
        await refused(b, tenant)

        async def admitted() -> bool:
            with contextlib.suppress(QuotaExceeded):
                async with b.admit(tenant):
                    return True
            return False

        await eventually(admitted, timeout_s=3, what="the dead replica's lease to run out")


async def test_without_redis_each_replica_enforces_the_limits_alone_and_sharing_resumes_when_it_returns(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    tenant = TenantInfo(1, "acme", max_concurrent_streams=1, requests_per_minute=0)
    many = TenantInfo(2, "many", max_concurrent_streams=0, requests_per_minute=1000)
    async with replicas(redis_server.shared) as (a, b):
        async with a.admit(tenant):
            await refused(b, tenant)  # shared
        await admit_at_once(a, many, 8)  # eight connections in the pool, each to go stale
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="gateway.shared_level"):
            async with a.admit(tenant), b.admit(tenant):  # served, each replica on its own
                await refused(a, tenant)
                await refused(b, tenant)
        assert [r.message.split(" (")[0] for r in caplog.records].count(
            f"Redis at {redis_server.url} is unreachable"
        ) == 2  # once per replica, not per call
        redis_server.start()
        await eventually(lambda: a.shared.available and b.shared.available, timeout_s=5, what="Redis back")
        await admit_at_once(a, many, 8)  # on the stale connections: each is made anew, none fails
        assert a.shared.available and len(caplog.records) == 2
        async with a.admit(tenant):
            await refused(b, tenant)  # shared again


async def admit_at_once(quotas: SharedQuotas, tenant: TenantInfo, n: int) -> None:
    """`n` calls admitted at the same moment (so on `n` connections), all open together."""
    all_in = asyncio.Barrier(n + 1)

    async def call() -> None:
        async with quotas.admit(tenant):
            await all_in.wait()

    calls = [asyncio.create_task(call()) for _ in range(n)]
    await all_in.wait()
    await asyncio.gather(*calls)
