"""Gateway + worker over real gRPC: streaming, every error status, cancellation, load sharing, drain."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.server import request_limits
from gateway.tenants import create_tenant, revoke_tenant
from gateway.validation import worker_request
from reflow.settings import Settings
from reflow.store.database import open_db
from reflow.v1 import inference_pb2, worker_pb2
from tests.support.stack import Stack, generate, held_stream, request, start_stack, start_worker, stop_stack
from tests.support.waiting import eventually
from workers.server import loaded_to_pb, params_from_pb

P = inference_pb2
USER = P.ChatMessage(role="user", content="47+38=")


async def status_of(stack: Stack, req: P.GenerateRequest, metadata: object = None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stack.stub.Generate(req, metadata=stack.metadata if metadata is None else metadata):
            pass
    return info.value.code()


async def test_stream_carries_header_first_and_usage_last(stack: Stack) -> None:
    messages = await generate(stack, request(max_tokens=12))
    first, last = messages[0], messages[-1]
    assert len(first.request_id) == 48 and int(first.request_id, 16) >= 0  # hex, signed for the tenant
    assert (first.model, first.model_version, first.arm) == ("arith", "1", "champion")
    assert all(m.finish_reason == P.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert last.finish_reason in (P.FINISH_REASON_STOP, P.FINISH_REASON_LENGTH)
    assert last.usage.prompt_tokens == 7  # <bos> + "47+38="
    # one message per token, unless a reader fell behind and deltas were coalesced: on a loaded
    # machine all twelve can arrive as one, so a message count above one is not asserted
    assert len(messages) <= last.usage.completion_tokens <= 12
    assert last.usage.completion_tokens == 12 or last.finish_reason == P.FINISH_REASON_STOP
    assert 0 < last.usage.time_to_first_token_ms <= last.usage.total_ms


async def test_a_tenant_reuses_its_own_cached_prompt_blocks_never_another_tenants(stack: Stack) -> None:
    _, other_key = create_tenant(open_db(stack.settings.resolved_database_url), "globex")
    other = (("authorization", f"Bearer {other_key}"),)
    long = request("1234567890123456789+1=", max_tokens=4)  # 23 tokens: one full 16-token block

    async def reused(metadata: object) -> tuple[int, str]:
        messages = [m async for m in stack.stub.Generate(long, metadata=metadata)]
        return messages[-1].usage.cached_tokens, "".join(m.text for m in messages)

    ours = [await reused(stack.metadata) for _ in range(2)]
    theirs = [await reused(other) for _ in range(2)]
    assert [hit for hit, _ in ours + theirs] == [0, 16, 0, 16]  # each tenant prefills it once
    assert len({text for _, text in ours + theirs}) == 1


async def test_gateway_output_equals_the_workers_own(stack: Stack) -> None:
    via_gateway = "".join(m.text + m.reasoning_text for m in await generate(stack, request(max_tokens=20)))
    direct = worker_pb2.WorkerGenerateRequest(
        model="arith", version="1", prompt="47+38=", sampling=P.SamplingParams(max_tokens=20)
    )
    from_worker = "".join([m.text + m.reasoning_text async for m in stack.worker_stub().Generate(direct)])
    assert via_gateway == from_worker


async def test_versions_by_number_and_alias(stack: Stack) -> None:
    messages = await generate(stack, request(model="arith/1"))
    assert (messages[0].model_version, messages[0].arm) == ("1", "")  # pinned: no arm
    assert await status_of(stack, request(model="arith/2")) == grpc.StatusCode.NOT_FOUND
    await stack.worker_stub().Load(worker_pb2.LoadRequest(model="arith", alias="other"))
    await stack.pool.refresh()
    other = (await generate(stack, request(model="arith@other")))[0]
    assert (other.model_version, other.arm) == ("2", "other")
    await stack.worker_stub().Load(worker_pb2.LoadRequest(model="arith", version="1"))  # already loaded
    await stack.pool.refresh()
    assert (await generate(stack, request()))[0].model_version == "1"  # still @champion
    assert (await generate(stack, request(model="arith/2")))[0].model_version == "2"


async def test_seeded_sampling_is_reproducible_through_the_gateway(stack: Stack) -> None:
    sampling = P.SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11)
    req = P.GenerateRequest(prompt="5+5=", sampling=sampling)
    texts = ["".join(m.text + m.reasoning_text for m in await generate(stack, req)) for _ in range(2)]
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request(prompt=""), "prompt and messages are both empty"),
        (request(messages=[USER]), "send prompt or messages, not both"),
        (request(prompt="", messages=[USER, P.ChatMessage(content="hi")]), "messages[1].role is empty"),
        (request(prompt="", messages=[P.ChatMessage(role="r" * 33)]), "role is longer than 32"),
        (
            request(prompt="", messages=[USER, P.ChatMessage(role="user", content="1" * 4091)]),
            "contents are 4097 characters",
        ),
        (request(prompt="1" * 5000), "limit is 4096"),
        (request(max_tokens=64), "max_tokens must be between 1 and 63"),
        (P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(temperature=-1)), "temperature"),
        (P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(temperature=1e-30)), "0 (greedy)"),
        (P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(top_p=1.5)), "top_p"),
        (P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(stop=[""])), "stop strings"),
        (request(model="arith/x"), "must be a number"),
        (request(model="arith/1@x"), "NAME, NAME@ALIAS or NAME/VERSION"),
        (request(prompt="9" * 80), "takes at most 63"),  # too long for the model's context
    ],
)
async def test_invalid_arguments(stack: Stack, req: P.GenerateRequest, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stack, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


async def test_authentication(stack: Stack) -> None:
    assert await status_of(stack, request(), metadata=()) == grpc.StatusCode.UNAUTHENTICATED
    bad = (("authorization", "Bearer rf_not_a_real_key_at_all"),)
    assert await status_of(stack, request(), metadata=bad) == grpc.StatusCode.UNAUTHENTICATED
    basic = (("authorization", f"Basic {stack.api_key}"),)
    assert await status_of(stack, request(), metadata=basic) == grpc.StatusCode.UNAUTHENTICATED


async def test_a_revoked_key_stops_working_within_the_cache_ttl(stack: Stack) -> None:
    await generate(stack, request())  # caches the key
    assert revoke_tenant(open_db(stack.settings.resolved_database_url), "acme")
    # that the key still works until then, tests/gateway/test_tenants.py asserts on a clock of its
    # own: here, a loaded machine could let the 0.5 s pass before a second request
    await asyncio.sleep(stack.settings.auth_cache_ttl_s + 0.1)
    assert await status_of(stack, request()) == grpc.StatusCode.UNAUTHENTICATED


async def test_unknown_model_is_not_found(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stack, request(model="poetry"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "arith/1" in info.value.details()  # says what is served instead


async def test_concurrent_stream_quota(settings: Settings) -> None:
    stack = await start_stack(settings, max_concurrent_streams=1)
    try:
        async with held_stream(stack):  # one stream open
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stack, request())
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in info.value.details()
        await eventually(lambda: admitted(stack), what="the closed stream's slot to be free again")
    finally:
        await stop_stack(stack)


async def admitted(stack: Stack) -> bool:
    """Whether a request goes through rather than being refused for a quota."""
    try:
        await generate(stack, request(max_tokens=1))
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False
    return True


async def test_request_rate_quota(settings: Settings) -> None:
    stack = await start_stack(settings, requests_per_minute=2)
    try:
        await generate(stack, request(max_tokens=1))
        await generate(stack, request(max_tokens=1))
        assert await status_of(stack, request(max_tokens=1)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await stop_stack(stack)


async def test_no_worker_is_unavailable(settings: Settings) -> None:
    stack = await start_stack(settings, n_workers=0, extra_addresses=("127.0.0.1:1",))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stack, request())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "reflow worker" in info.value.details()
    finally:
        await stop_stack(stack)


async def read_all(call: grpc.aio.UnaryStreamCall) -> list[P.GenerateResponse]:
    """Reads a call that was started with read() to its end."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def test_latency_budget_and_client_deadline(stack: Stack) -> None:
    slow = request(max_tokens=60, latency_budget_ms=1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stack, slow)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "latency_budget_ms" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(stack, request(max_tokens=60), timeout=0.005)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    engine = stack.workers[0].engine
    await eventually(lambda: engine.running == 0, what="the worker to drop the abandoned streams")


async def test_cancelling_a_stream_frees_the_worker(stack: Stack) -> None:
    engine = stack.workers[0].engine
    call = stack.stub.Generate(request(max_tokens=60), metadata=stack.metadata)
    await call.read()
    assert engine.running == 1
    call.cancel()
    await eventually(lambda: engine.running == 0, what="the worker to drop the cancelled stream")


async def test_two_workers_share_the_load(settings: Settings) -> None:
    stack = await start_stack(settings, n_workers=2)
    served: list[int] = []
    try:
        calls = [stack.stub.Generate(request(max_tokens=40), metadata=stack.metadata) for _ in range(4)]
        for call in calls:
            await call.read()
        served = [w.engine.running for w in stack.workers]
        for call in calls:
            call.cancel()
    finally:
        await stop_stack(stack)
    assert served == [2, 2]


async def test_a_dead_worker_is_retried_on_another(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings.worker_poll_s = 3600  # the pool still believes the dead worker is healthy
    stack = await start_stack(settings, n_workers=2)
    try:
        await stack.workers[0].server.stop(0)
        for _ in range(2):
            assert (await generate(stack, request()))[-1].finish_reason != P.FINISH_REASON_UNSPECIFIED
        assert "before the first token; trying another" in caplog.text
    finally:
        await stop_stack(stack)


async def test_when_no_other_worker_holds_the_version_the_retry_is_unavailable(settings: Settings) -> None:
    settings.worker_poll_s = 3600
    stack = await start_stack(settings)
    try:
        stack.workers.append(await start_worker(settings, alias="other"))  # serves only arith@other
        stack.pool.workers.append(stack.pool._connect(stack.workers[1].address))
        await stack.pool.refresh()
        await stack.workers[0].server.stop(0)
        assert await status_of(stack, request()) == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_stack(stack)


async def test_a_worker_dying_mid_stream_is_unavailable(stack: Stack) -> None:
    call = stack.stub.Generate(request(max_tokens=60), metadata=stack.metadata)
    await call.read()
    await stack.workers[0].server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await read_all(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "mid-stream" in info.value.details()


async def test_stop_strings_and_reasoning_budget_reach_the_worker(stack: Stack) -> None:
    plain = "".join(m.text for m in await generate(stack, request(max_tokens=30)))
    assert len(plain) > 6
    stop = plain[4:6]
    cut = await generate(
        stack, P.GenerateRequest(prompt="47+38=", sampling=P.SamplingParams(max_tokens=30, stop=[stop]))
    )
    assert "".join(m.text for m in cut) == plain[: plain.index(stop)]
    assert cut[-1].finish_reason == P.FINISH_REASON_STOP
    # The whole conversion chain, gateway request -> worker request -> decode parameters:
    loaded = stack.workers[0].servicer.engine.get("arith", "1")
    outgoing = worker_request(
        P.GenerateRequest(
            prompt="1+1=", reasoning_budget=7,
            sampling=P.SamplingParams(
                stop=["x"], top_k=3, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
                logit_bias={9: -100.0, 3: 2.5},
            ),
        ),
        request_limits(stack.settings),
        request_id="r",
        loaded=loaded_to_pb(loaded, stack.workers[0].servicer.engine),
    )  # fmt: skip
    params = params_from_pb(outgoing, loaded.model.vocab_size)
    assert (params.reasoning_budget, params.stop, params.sampling.top_k) == (7, ("x",), 3)
    sampling = params.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (
        0.5,
        -1,
        1.25,
    )
    assert sampling.logit_bias == ((3, 2.5), (9, -100.0))
    assert params.max_tokens == min(stack.settings.default_max_tokens, loaded.max_len - 1)


async def test_messages_reach_the_worker_which_refuses_them_without_a_chat_template(stack: Stack) -> None:
    conversation = [P.ChatMessage(role="system", content="Add."), USER]
    engine = stack.workers[0].servicer.engine
    loaded = loaded_to_pb(engine.get("arith", "1"), engine)
    outgoing = worker_request(
        P.GenerateRequest(messages=conversation),
        request_limits(stack.settings),
        request_id="r",
        loaded=loaded,
    )
    assert (list(outgoing.messages), outgoing.prompt) == (conversation, "")
    with pytest.raises(grpc.aio.AioRpcError) as info:  # the built-in model has no chat template
        await generate(stack, P.GenerateRequest(messages=conversation))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("arith/1: ") and "no chat template" in info.value.details()


async def test_shutdown_drains_in_flight_streams(stack: Stack) -> None:
    call = stack.stub.Generate(request(max_tokens=60), metadata=stack.metadata)
    first = await call.read()
    stopping = asyncio.create_task(stack.gateway.drain(10))
    await asyncio.sleep(0.05)
    rest = await read_all(call)
    await stopping
    assert first.request_id and rest[-1].finish_reason == P.FINISH_REASON_LENGTH
    with pytest.raises(grpc.aio.AioRpcError) as info:  # nothing new is accepted
        await generate(stack, request())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_list_models(stack: Stack) -> None:
    reply = await stack.stub.ListModels(P.ListModelsRequest(), metadata=stack.metadata)
    assert [
        (m.name, [(v.version, list(v.aliases), v.ready_workers) for v in m.versions]) for m in reply.models
    ] == [("arith", [("1", ["champion"], 1)])]
    assert not reply.models[0].versions[0].variants  # none without REFLOW_VARIANTS


async def test_list_models_reports_the_variants_the_workers_measured(settings: Settings) -> None:
    stack = await start_stack(settings.model_copy(update={"variants": ["int8"]}))
    try:
        reply = await stack.stub.ListModels(P.ListModelsRequest(), metadata=stack.metadata)
        reference, int8 = reply.models[0].versions[0].variants
        assert (reference.name, reference.greedy_agreement) == ("float32", 1.0)
        assert int8.name == "int8" and 0.0 <= int8.greedy_agreement < 1.0
        assert reference.token_agreement == 1.0 and 0.0 < int8.token_agreement < 1.0
        metrics = stack.workers[0].servicer.engine.metrics
        assert metrics is not None
        gauge = metrics.registry.get_sample_value(
            "reflow_worker_variant_greedy_agreement", {"model": "arith", "version": "1", "variant": "int8"}
        )
        assert gauge == pytest.approx(int8.greedy_agreement)
        token = metrics.registry.get_sample_value(
            "reflow_worker_variant_token_agreement", {"model": "arith", "version": "1", "variant": "int8"}
        )
        assert token == pytest.approx(int8.token_agreement)
    finally:
        await stop_stack(stack)


@pytest.mark.parametrize("target", ["gateway", "worker"])
async def test_health_and_reflection(stack: Stack, target: str) -> None:
    address = stack.address if target == "gateway" else stack.workers[0].address
    service = "reflow.v1.Inference" if target == "gateway" else "reflow.v1.Worker"
    async with grpc.aio.insecure_channel(address) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service)
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for r in replies for s in r.list_services_response.service}
    assert {service, "grpc.health.v1.Health"} <= names


async def test_worker_status_reports_versions_and_memory(stack: Stack) -> None:
    status = await stack.worker_stub().Status(worker_pb2.WorkerStatusRequest())
    assert [(v.model, v.version, list(v.aliases), v.device) for v in status.loaded] == [
        ("arith", "1", ["champion"], "cpu")
    ]
    assert status.memory_bytes > 10_000_000 and status.running == 0
    assert status.loaded[0].parameters > 0 and status.loaded[0].max_sequence_length == 64
    start = time.perf_counter()
    unloaded = await stack.worker_stub().Unload(worker_pb2.UnloadRequest(model="arith", version="1"))
    assert unloaded.unloaded and time.perf_counter() - start < 5
    assert not (await stack.worker_stub().Status(worker_pb2.WorkerStatusRequest())).loaded
