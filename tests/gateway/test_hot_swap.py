"""Workers follow aliases moved in the registry: hot-swap under load, with eager and compiled steps."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from reflow.registry import Registry
from reflow.settings import Settings
from reflow.v1 import inference_pb2
from tests.support.models import MODEL, collect, reference_greedy, tiny_model
from tests.support.stack import Stack, WorkerUnderTest, start_stack, start_worker, stop_stack
from tests.support.waiting import eventually
from workers.engine import EngineConfig
from workers.follower import AliasFollower
from workers.sequence import GenerationParams

P = inference_pb2
PROMPTS = ["47+38=", "1+1=", "99+9=", "5+60="]


@contextlib.asynccontextmanager
async def following(worker: WorkerUnderTest, settings: Settings) -> AsyncIterator[AliasFollower]:
    follower = AliasFollower(worker.servicer.versions, MODEL, ["champion"], poll_s=0.2, retire_idle_s=0.5)
    task = asyncio.create_task(follower.run())
    try:
        yield follower
    finally:
        task.cancel()


def move_champion(settings: Settings, version: str) -> None:
    Registry.from_settings(settings).set_alias(MODEL, "champion", version)


async def answer(stack: Stack, prompt: str) -> tuple[str, str]:
    """(model_version, reasoning + text) of one greedy completion through the gateway."""
    request = P.GenerateRequest(prompt=prompt, sampling=P.SamplingParams(max_tokens=12))
    messages = [m async for m in stack.stub.Generate(request, metadata=stack.metadata)]
    return messages[0].model_version, "".join(m.reasoning_text + m.text for m in messages)


async def test_an_alias_moved_by_hand_is_served_within_the_poll_interval(swap_settings: Settings) -> None:
    stack = await start_stack(swap_settings)
    worker = stack.workers[0]
    try:
        async with following(worker, swap_settings):
            assert (await answer(stack, "12+30="))[0] == "1"
            move_champion(swap_settings, "2")
            await eventually(lambda: _serves(stack, "2"))
            engine = worker.engine
            out = await collect(engine, "12+30=", GenerationParams(max_tokens=12), version="2")
            assert out.token_ids == reference_greedy(tiny_model(1), "12+30=", 12)
            await eventually(lambda: _unloaded(worker, "1"))  # no alias, no traffic: freed
    finally:
        await stop_stack(stack)


async def test_a_worker_that_freed_the_version_a_gateway_routes_to_serves_the_alias_now(
    swap_settings: Settings,
) -> None:
    # the gateway polls once an hour: it still sends the champion to v1 after the worker freed it
    stack = await start_stack(swap_settings.model_copy(update={"worker_poll_s": 3600.0}))
    worker = stack.workers[0]
    try:
        assert (await answer(stack, "12+30="))[0] == "1"
        async with following(worker, swap_settings):
            move_champion(swap_settings, "2")
            await eventually(lambda: _unloaded(worker, "1"))
        assert (await answer(stack, "12+30="))[0] == "2"  # refused as v1, asked again as v2
    finally:
        await stop_stack(stack)


async def _serves(stack: Stack, version: str) -> bool:
    return (await answer(stack, "12+30="))[0] == version


async def _unloaded(worker: WorkerUnderTest, version: str) -> bool:
    return worker.engine.find(MODEL, version) is None


async def test_a_swap_under_continuous_load_fails_no_request_and_changes_no_output(
    swap_settings: Settings,
) -> None:
    stack = await start_stack(swap_settings, max_concurrent_streams=64, requests_per_minute=0)
    results: list[tuple[str, str, str]] = []  # (prompt, version, output)
    failures: list[grpc.aio.AioRpcError] = []
    stop = asyncio.Event()

    async def client(i: int) -> None:
        while not stop.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                results.append((prompt, *await answer(stack, prompt)))
            except grpc.aio.AioRpcError as error:
                failures.append(error)

    try:
        async with following(stack.workers[0], swap_settings):
            clients = [asyncio.create_task(client(i)) for i in range(8)]
            await eventually(lambda: len(results) >= 8, what="answers from version 1")
            move_champion(swap_settings, "2")
            await eventually(lambda: _unloaded(stack.workers[0], "1"))
            swapped = len(results)
            await eventually(lambda: len(results) >= swapped + 8, what="answers after the swap")
            stop.set()
            await asyncio.gather(*clients)
    finally:
        await stop_stack(stack)
    assert failures == []
    versions = [version for _, version, _ in results]
    assert versions[0] == "1" and versions[-1] == "2" and "1" in versions and "2" in versions
    outputs: dict[tuple[str, str], set[str]] = {}
    for prompt, version, output in results:
        outputs.setdefault((prompt, version), set()).add(output)
    assert all(len(seen) == 1 for seen in outputs.values()), outputs  # token-exact per version
    assert any(outputs[(p, "1")] != outputs[(p, "2")] for p in PROMPTS if (p, "1") in outputs)


async def test_the_compiled_step_serves_the_new_weights_after_a_swap(swap_settings: Settings) -> None:
    worker = await start_worker(swap_settings, config=EngineConfig(compile=True, max_batch_size=4))
    try:
        params = GenerationParams(max_tokens=12)
        follower = AliasFollower(worker.servicer.versions, MODEL, ["champion"], poll_s=60, retire_idle_s=0)
        before = await collect(worker.engine, "47+38=", params, version="1")
        move_champion(swap_settings, "2")
        await follower.sync()  # loads, compiles and warms v2, moves the alias
        after = await collect(worker.engine, "47+38=", params, version="2")
        assert before.token_ids == reference_greedy(tiny_model(0), "47+38=", 12)
        assert after.token_ids == reference_greedy(tiny_model(1), "47+38=", 12)
        assert after.token_ids != before.token_ids
        assert worker.engine.get(MODEL, "2").aliases == {"champion"}
        await follower.sync()  # v1 lost its alias and is idle: unloaded
        assert worker.engine.find(MODEL, "1") is None
    finally:
        await worker.server.stop(0)
        worker.engine.close()
