"""Batching seen through the gateway: backpressure, coalesced relays, and the metrics endpoints."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request

import grpc
import pytest

from gateway.relay import merge_worker_deltas
from reflow.errors import RETRY_PUSHBACK_KEY
from reflow.serving import start_metrics_server
from reflow.settings import Settings
from reflow.v1 import inference_pb2 as P
from reflow.v1 import worker_pb2
from tests.support.stack import Stack, start_stack, stop_stack
from tests.support.waiting import eventually
from workers.engine import EngineConfig


def request(prompt: str = "47+38=", max_tokens: int = 12) -> P.GenerateRequest:
    return P.GenerateRequest(prompt=prompt, sampling=P.SamplingParams(max_tokens=max_tokens))


def scrape(url: str) -> dict[str, float]:
    """Prometheus text exposition as {'name{labels}': value}."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in lines if line and line[0] != "#")}


async def test_a_full_worker_queue_is_resource_exhausted_with_pushback(settings: Settings) -> None:
    stack = await start_stack(settings, engine_config=EngineConfig(max_batch_size=1, max_waiting=1))
    engine = stack.workers[0].engine
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # on the engine thread, between two steps: no request moves meanwhile
        held.set()
        release.wait()

    holding = None
    try:
        running = stack.stub.Generate(request(max_tokens=60), metadata=stack.metadata)
        await running.read()  # it runs: the one batch row is taken
        holding = asyncio.get_running_loop().run_in_executor(None, engine.run, hold)
        await eventually(held.is_set, what="the engine thread held")
        waiting = stack.stub.Generate(request(max_tokens=3), metadata=stack.metadata)
        await eventually(lambda: engine.waiting == 1, what="the second request queued")
        call = stack.stub.Generate(request(max_tokens=3), metadata=stack.metadata)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), 30)  # queued instead, it would wait for the engine
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in info.value.details()
        assert int(dict(info.value.trailing_metadata())[RETRY_PUSHBACK_KEY]) > 0
        release.set()
        running.cancel()
        assert [m async for m in waiting][-1].finish_reason != P.FINISH_REASON_UNSPECIFIED
    finally:
        release.set()
        if holding is not None:
            await holding
        await stop_stack(stack)


async def test_many_concurrent_streams_all_finish_exactly(stack: Stack) -> None:
    async def text(prompt: str) -> str:
        return "".join(
            [
                m.text + m.reasoning_text
                async for m in stack.stub.Generate(request(prompt, 20), metadata=stack.metadata)
            ]
        )

    prompts = [f"{a}+{a}=" for a in range(24)]
    alone = [await text(p) for p in prompts]
    assert await asyncio.gather(*(text(p) for p in prompts)) == alone


async def test_metrics_endpoints_expose_plausible_series(stack: Stack) -> None:
    started = time.monotonic()
    calls = [
        [m async for m in stack.stub.Generate(request(max_tokens=10), metadata=stack.metadata)]
        for _ in range(3)
    ]
    with pytest.raises(grpc.aio.AioRpcError):
        await stack.stub.Generate(request(prompt=""), metadata=stack.metadata).read()
    took_s = time.monotonic() - started  # the three calls' first tokens came within it: seconds, not ms
    tokens = sum(c[-1].usage.completion_tokens for c in calls)
    worker_metrics = stack.workers[0].engine.metrics
    assert worker_metrics is not None
    gateway_server, gateway_url = start_metrics_server(stack.metrics.registry, "127.0.0.1", 0)
    worker_server, worker_url = start_metrics_server(worker_metrics.registry, "127.0.0.1", 0)
    try:
        g, w = scrape(gateway_url), scrape(worker_url)
    finally:
        gateway_server.shutdown()
        worker_server.shutdown()
    assert g['reflow_gateway_requests_total{code="OK",method="Generate"}'] == 3
    assert g['reflow_gateway_requests_total{code="INVALID_ARGUMENT",method="Generate"}'] == 1
    assert g['reflow_gateway_generations_total{arm="champion",model="arith",tenant="acme"}'] == 3
    assert g["reflow_gateway_relayed_tokens_total"] == tokens
    assert g["reflow_gateway_time_to_first_token_seconds_count"] == 3
    assert g["reflow_gateway_inter_token_seconds_count"] == tokens - 3
    assert g["reflow_gateway_streams_in_flight"] == 0
    assert w["reflow_worker_generated_tokens_total"] == tokens
    assert w["reflow_worker_time_to_first_token_seconds_count"] == 3
    assert w["reflow_worker_queue_seconds_count"] == 3
    assert w["reflow_worker_inter_token_seconds_count"] == tokens - 3
    assert 0 < w["reflow_worker_time_to_first_token_seconds_sum"] < took_s
    assert w["reflow_worker_decode_batch_size_count"] >= tokens - 3 - 6  # one decode per later token
    assert w["reflow_worker_kv_slots"] == 64
    assert w["reflow_worker_kv_blocks"] == 64 * 4  # a full context (64 tokens) per batch row
    assert (w["reflow_worker_kv_blocks_used"], w["reflow_worker_kv_cache_usage"]) == (0, 0)
    assert (w["reflow_worker_running_sequences"], w["reflow_worker_waiting_sequences"]) == (0, 0)
    assert sum(v for k, v in w.items() if k.startswith("reflow_worker_sequences_finished_total")) == 3


def test_coalesced_deltas_keep_each_tool_call_whole_and_in_order() -> None:
    def delta(*pieces: P.ToolCallDelta) -> worker_pb2.WorkerGenerateResponse:
        return worker_pb2.WorkerGenerateResponse(tool_calls=pieces)

    earlier = delta(P.ToolCallDelta(index=0, id="call_1", name="f", arguments='{"a"'))
    merge_worker_deltas(earlier, delta(P.ToolCallDelta(index=0, arguments=": 1}")))
    merge_worker_deltas(
        earlier,
        delta(P.ToolCallDelta(index=1, id="call_2", name="g"), P.ToolCallDelta(index=1, arguments="{}")),
    )
    assert list(earlier.tool_calls) == [
        P.ToolCallDelta(index=0, id="call_1", name="f", arguments='{"a": 1}'),
        P.ToolCallDelta(index=1, id="call_2", name="g", arguments="{}"),
    ]
