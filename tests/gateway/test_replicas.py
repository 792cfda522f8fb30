"""Gateway replicas sharing one Redis, end to end: two gateways in front of the same worker hold
one tenant's quota between them on both faces, a key revoked with `reflow tenants revoke` is
refused by every replica within a second, and a Redis outage leaves both serving on their own
until it returns."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import grpc
import openai
import pytest

from reflow.settings import Settings
from reflow.v1 import inference_pb2 as P
from tests.support.cli import reflow
from tests.support.redis import RedisServer, SharedRedis
from tests.support.stack import Stack, request, start_replica, start_stack, stop_stack
from tests.support.waiting import eventually


async def status_of(replica: Stack, req: P.GenerateRequest) -> grpc.StatusCode:
    """How a Generate on `replica` ends."""
    try:
        async for _ in replica.stub.Generate(req, metadata=replica.metadata):
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


@contextlib.asynccontextmanager
async def replicas(settings: Settings, **limits: int) -> AsyncIterator[tuple[Stack, Stack]]:
    """A stack (a worker, the store, a tenant with `limits`, a gateway) and a second gateway
    replica in front of the same worker."""
    stack = await start_stack(settings, **limits)
    replica = await start_replica(stack)
    try:
        yield stack, replica
    finally:
        await stop_stack(replica)
        await stop_stack(stack)


def redis_up(gateway: Stack) -> float | None:
    """The gateway's reflow_gateway_redis_up, as Prometheus reads it."""
    return gateway.metrics.registry.get_sample_value("reflow_gateway_redis_up")


def http_client(replica: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{replica.http_url}/v1", api_key=replica.api_key, max_retries=0)


async def test_two_replicas_share_a_tenants_four_streams_on_both_faces(
    settings: Settings, shared_redis: SharedRedis
) -> None:
    settings = shared_redis.settings(settings)
    async with replicas(settings, max_concurrent_streams=4, requests_per_minute=0) as (stack, replica):
        engine = stack.workers[0].engine
        release = threading.Event()
        stalled = asyncio.create_task(asyncio.to_thread(engine.run, release.wait))  # no step runs meanwhile
        try:
            held = [
                asyncio.create_task(status_of(gateway, request(max_tokens=4)))
                for gateway in (stack, stack, replica, replica)
            ]
            await eventually(lambda: engine.waiting == 4, what="four streams to queue at the worker")
            assert await status_of(replica, request()) == grpc.StatusCode.RESOURCE_EXHAUSTED  # the fifth
            with pytest.raises(openai.RateLimitError, match="its 4 concurrent streams") as refused:
                await http_client(stack).completions.create(model="arith", prompt="1+1=")
            assert int(refused.value.response.headers["retry-after"]) >= 1
            release.set()
            await stalled
            assert await asyncio.gather(*held) == [grpc.StatusCode.OK] * 4
            assert await status_of(replica, request()) == grpc.StatusCode.OK  # ended ones let the next in
            refused_streams = ("reflow_gateway_quota_refusals_total", {"quota": "streams"})
            refusals = [g.metrics.registry.get_sample_value(*refused_streams) for g in (stack, replica)]
            assert refusals == [1.0, 1.0]
        finally:
            release.set()


async def test_streams_cancelled_on_either_face_give_their_slot_back_at_once(
    settings: Settings, shared_redis: SharedRedis
) -> None:
    settings = shared_redis.settings(settings)
    async with replicas(settings, max_concurrent_streams=2, requests_per_minute=0) as (stack, replica):
        for i in range(10):  # five times the quota, each cancelled after its first message
            gateway = (stack, replica)[i % 2]
            call = gateway.stub.Generate(request(max_tokens=60), metadata=gateway.metadata)
            await call.read()
            call.cancel()
            async with http_client(gateway).completions.with_streaming_response.create(
                model="arith", prompt="1+1=", max_tokens=60, stream=True
            ) as response:
                await anext(response.iter_lines())
        await eventually(lambda: shared_redis.held_slots() == [], timeout_s=2, what="every slot given back")


async def test_a_key_revoked_through_the_cli_is_refused_by_both_replicas_long_before_their_caches_expire(
    settings: Settings, shared_redis: SharedRedis
) -> None:
    """The key stays cached for 10 minutes: a refusal within the wait can only come from the
    revocation's announcement (how soon it comes is a matter of load, not of the test)."""
    settings = shared_redis.settings(settings.model_copy(update={"auth_cache_ttl_s": 600.0}))
    async with replicas(settings) as (stack, replica):
        for gateway in (stack, replica):  # the key is in both replicas' L1, and in L2
            assert await status_of(gateway, request(max_tokens=1)) == grpc.StatusCode.OK
        env = {"REFLOW_DATA_DIR": str(settings.data_dir), "REFLOW_REDIS_URL": shared_redis.url,
               "REFLOW_REDIS_PREFIX": shared_redis.prefix}  # fmt: skip
        revoke = await asyncio.to_thread(reflow, "tenants", "revoke", "acme", env=env)
        assert revoke.returncode == 0 and revoke.stderr == "", revoke.stderr  # announced: nothing to warn of
        for gateway in (replica, stack):
            await eventually(
                lambda gateway=gateway: _refused(gateway),
                timeout_s=60,
                what="the revocation to reach the replica",
            )


async def _refused(gateway: Stack) -> bool:
    return await status_of(gateway, request(max_tokens=1)) == grpc.StatusCode.UNAUTHENTICATED


async def test_without_redis_both_replicas_serve_and_they_share_again_once_it_is_back(
    settings: Settings, redis_server: RedisServer
) -> None:
    settings = redis_server.shared.settings(settings)
    async with replicas(settings, max_concurrent_streams=1, requests_per_minute=0) as (stack, replica):
        engine = stack.workers[0].engine
        redis_server.stop()
        # each replica serves with its own count: one stream apiece, on either face
        answers = await asyncio.gather(
            status_of(stack, request(max_tokens=4)),
            http_client(replica).completions.create(model="arith", prompt="1+1=", max_tokens=4),
        )
        assert answers[0] == grpc.StatusCode.OK and answers[1].choices[0].text is not None
        assert [redis_up(g) for g in (stack, replica)] == [0, 0]
        redis_server.start()
        await eventually(
            lambda: [redis_up(g) for g in (stack, replica)] == [1, 1],
            timeout_s=5,
            what="both replicas back on Redis",
        )  # (the probe runs every second)
        release = threading.Event()
        stalled = asyncio.create_task(asyncio.to_thread(engine.run, release.wait))
        held = asyncio.create_task(status_of(stack, request(max_tokens=4)))
        await eventually(lambda: engine.waiting == 1, what="a stream to queue at the worker")
        assert await status_of(replica, request()) == grpc.StatusCode.RESOURCE_EXHAUSTED  # shared again
        release.set()
        await stalled
        assert await held == grpc.StatusCode.OK
