"""Latency budgets end to end: a gateway in front of a real worker places each request on the
variant its budget allows (SmolLM2-135M, float32 and int8), lowers the reasoning budget of a
thinking model (the demo's) when the budget needs it, and says so in the response, the HTTP
headers and the inference event."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import grpc
import httpx
import pytest

from feedback.bus.kafka import INFERENCES_TOPIC
from gateway.placement import Placement
from gateway.routing import ModelSpec
from reflow.registry import Registry
from reflow.settings import Settings
from reflow.v1 import inference_pb2
from tests.support.kafka import Broker
from tests.support.stack import Stack, generate, start_stack, stop_stack
from tests.support.waiting import eventually

P = inference_pb2
pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


def predicted(stack: Stack, request: P.GenerateRequest) -> Placement:
    """Where the stack's gateway would place `request` now, with no deadline (its predictions)."""
    spec = ModelSpec.parse(request.model, stack.settings.model_name, "champion")
    return stack.gateway.service.relay.placer.place(spec, request, None)


def budgeted(request: P.GenerateRequest, budget_ms: float) -> P.GenerateRequest:
    copy = P.GenerateRequest()
    copy.CopyFrom(request)
    copy.latency_budget_ms = int(budget_ms)
    return copy


async def served(stack: Stack, request: P.GenerateRequest) -> list[P.GenerateResponse]:
    """The messages of one Generate call; those before DEADLINE_EXCEEDED when the budget ran out
    (a misprediction on a noisy machine: the placement, in the first message, is what is tested)."""
    messages: list[P.GenerateResponse] = []
    try:
        async for message in stack.stub.Generate(request, metadata=stack.metadata, timeout=120):
            messages.append(message)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and request.latency_budget_ms, error
    assert messages, "no first message"
    return messages


async def measured_int8_four_times_faster(stack: Stack, spec: ModelSpec) -> None:
    """States the speeds the worker measured when int8 loaded: four times float32's. Which of the two
    measures faster is what a budget turns on, and on a loaded machine that is luck (benchmarks/sla.py
    and benchmarks/variants.py measure them); the gateway's latency model is seeded from them."""
    (reference, _), (int8, _) = stack.workers[0].engine.copies(spec.name, "1")
    assert reference.quality is not None and not int8.reference and int8.quality is not None
    speeds = {"prefill_ms_per_token": reference.quality.prefill_ms_per_token / 4,
              "decode_ms_per_token": reference.quality.decode_ms_per_token / 4}  # fmt: skip
    int8.quality = replace(int8.quality, **speeds)

    def seen() -> bool:
        return any(
            v.name == "int8" and v.decode_ms_per_token == pytest.approx(speeds["decode_ms_per_token"])
            for _, loaded in stack.pool.candidates(spec, frozenset())
            for v in loaded.variants
        )

    await eventually(seen, what="the gateway to see the worker's stated speeds")


def idle(stack: Stack, spec: ModelSpec) -> bool:
    """Whether the gateway's last status of every worker serving `spec` shows nothing running."""
    return all(worker.reported_running == 0 for worker, _ in stack.pool.candidates(spec, frozenset()))


async def test_the_budget_picks_the_variant(
    settings: Settings, tmp_path: Path, kafka: Broker, smollm2: Path
) -> None:
    Registry.from_settings(settings).register("smollm2", smollm2, params={}, metrics={}, alias="champion")
    stack = await start_stack(settings.model_copy(update={"variants": ["int8"]}), model="smollm2")
    try:
        spec = ModelSpec("smollm2", alias="champion")
        await measured_int8_four_times_faster(stack, spec)
        request = P.GenerateRequest(model="smollm2", prompt=PROMPT, sampling=P.SamplingParams(max_tokens=16))
        unbudgeted = await served(stack, request)
        routing = unbudgeted[0].routing
        assert routing.variant == "float32" and routing.token_agreement == 1.0
        assert routing.predicted_total_ms > routing.predicted_time_to_first_token_ms > 0
        assert routing.predicted_to_meet_deadline

        await eventually(lambda: idle(stack, spec), what="the workers' status to say they are idle")
        options = {
            o.name: o.alone.total_ms for o in stack.gateway.service.relay.placer.options(spec, request)
        }
        tight = budgeted(request, options["float32"] * 0.97)  # only int8 is predicted to meet it
        fast = await served(stack, tight)
        assert fast[0].routing.variant == "int8" and fast[0].routing.token_agreement < 1.0
        assert fast[0].routing.predicted_to_meet_deadline

        generous = await served(stack, budgeted(request, options["float32"] * 10))
        assert generous[0].routing.variant == "float32"

        pinned = P.GenerateRequest()
        pinned.CopyFrom(request)
        pinned.variant = "int8"  # no deadline, yet int8 as asked
        assert (await served(stack, pinned))[0].routing.variant == "int8"
        pinned.variant = "int4"
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await generate(stack, pinned)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "float32, int8" in (missing.value.details() or "")

        async with httpx.AsyncClient(base_url=stack.http_url, timeout=60) as http:
            body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4}
            headers = {"authorization": f"Bearer {stack.api_key}"}
            reply = await http.post("/v1/completions", json=body, headers=headers)
            assert reply.status_code == 200 and reply.headers["x-reflow-variant"] == "float32"
            reply = await http.post("/v1/completions", json={**body, "variant": "int8"}, headers=headers)
            assert reply.status_code == 200 and reply.headers["x-reflow-variant"] == "int8"
            card = (await http.get("/v1/models/smollm2@champion", headers=headers)).json()
        variants = {v["name"]: v for v in card["variants"]}
        assert list(variants) == ["float32", "int8"] and variants["float32"]["token_agreement"] == 1.0
        assert 0 < variants["int8"]["token_agreement"] < 1.0 and variants["int8"]["task_score"] is None

        finished = [m[0].request_id for m in (unbudgeted, fast, generous) if m[-1].finish_reason]
        events = [json.loads(r.value) for r in kafka.read(INFERENCES_TOPIC, len(finished) + 1)]
        routed = {e["request_id"]: e["routing"] for e in events}
        assert routed[generous[0].request_id]["variant"] == "float32"
        assert routed[generous[0].request_id]["latency_budget_ms"] == int(options["float32"] * 10)
        if fast[-1].finish_reason:  # it met its budget: its event says int8 served it
            assert routed[fast[0].request_id]["variant"] == "int8"
    finally:
        await stop_stack(stack)


async def test_a_thinking_model_thinks_less_when_its_budget_needs_it(settings: Settings) -> None:
    stack = await start_stack(settings)  # the demo's arith model, which reasons
    try:
        request = P.GenerateRequest(prompt="47+38=", sampling=P.SamplingParams(max_tokens=48))
        for _ in range(3):  # the latency model learns the worker's speed
            await generate(stack, request)
        full = predicted(stack, request)
        assert full.reasoning_budget == 0 and full.option.loaded.reasons
        generous = await served(stack, budgeted(request, full.option.prediction.total_ms * 20 + 1000))
        assert generous[0].routing.reasoning_budget == 0  # untouched when the budget allows
        now = predicted(stack, request).option.prediction  # it learned from that one too
        tight = budgeted(request, max(now.total_ms / 2, 1))
        messages = await served(stack, tight)
        applied = messages[0].routing.reasoning_budget
        assert stack.settings.reasoning_budget_floor <= applied < 48
        assert messages[-1].usage.reasoning_tokens <= applied  # the worker thought no longer
    finally:
        await stop_stack(stack)
