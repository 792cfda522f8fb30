"""What a caller gets of a gateway before its key is checked, on both faces: no body read and no
message parsed, bodies and messages bounded, connections and calls bounded in number, request
headers bounded in time and size, and unknown keys throttled per address without a lookup."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from gateway import auth as auth_module
from gateway.tenants import TenantInfo, find_by_key
from reflow.errors import RETRY_PUSHBACK_KEY
from reflow.settings import Settings
from reflow.v1 import inference_pb2
from tests.support.stack import Stack, held_stream, request, start_stack, stop_stack
from tests.support.waiting import eventually

BOUND = 64 * 1024  # the least REFLOW_MAX_REQUEST_BYTES may be
UNKNOWN = (("authorization", "Bearer not-a-key-0123456789"),)
Response = tuple[int, dict[str, str], bytes]


def guessed(i: int) -> tuple[tuple[str, str]]:
    """The metadata (or headers) of the i-th of distinct unknown keys."""
    return (("authorization", f"Bearer guessed-key-{i:04d}-0123456789"),)


@pytest.fixture
async def bounded(settings: Settings) -> AsyncIterator[Stack]:
    """A gateway taking bodies and messages of BOUND bytes at most, and headers within a second."""
    stack = await start_stack(
        settings.model_copy(update={"max_request_bytes": BOUND, "header_timeout_s": 1.0})
    )
    yield stack
    await stop_stack(stack)


async def connect(stack: Stack) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", stack.gateway.http_port)


async def response_of(reader: asyncio.StreamReader) -> Response:
    """The status, headers and body of the next response on a connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {
        name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines if line)
    }
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (within 10 s: long past any timeout set here)."""
    return await asyncio.wait_for(reader.read(), 10) == b""


async def test_http_answers_an_unknown_key_before_reading_the_body(bounded: Stack) -> None:
    reader, writer = await connect(bounded)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer not-a-key-0123456789\r\ncontent-length: 60000\r\n\r\n"
        b'{"tools": [{}, {}, '  # and the rest never comes
    )
    status, _, body = await asyncio.wait_for(response_of(reader), 10)
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert await closed_by_server(reader)  # nor is the connection held for the rest of it
    writer.close()


async def test_http_bodies_past_max_request_bytes_are_413_by_length_or_as_they_arrive(bounded: Stack) -> None:
    async def chunked() -> AsyncIterator[bytes]:  # no content-length: sent chunked
        for _ in range(100):
            yield b" " * 1024

    completion = {"model": "arith", "prompt": "1+1=", "max_tokens": 2}
    at_bound = json.dumps(completion).encode().ljust(BOUND)  # whitespace after the object
    headers = {"authorization": f"Bearer {bounded.api_key}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=bounded.http_url, headers=headers, timeout=30) as http:
        assert (await http.post("/v1/completions", content=at_bound)).status_code == 200
        refused = [
            await http.post("/v1/completions", content=at_bound + b" "),
            await http.post("/v1/chat/completions", content=chunked()),
            await http.post("/v1/feedback", json=[{"request_id": "x" * 1000, "rating": 1}] * 80),
        ]
    for response in refused:
        assert response.status_code == 413, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert "REFLOW_MAX_REQUEST_BYTES" in response.json()["error"]["message"]


async def test_http_headers_must_come_within_the_timeout_and_64_kib(bounded: Stack) -> None:
    reader, writer = await connect(bounded)
    writer.write(b"POST /v1/compl")  # half a request line, then nothing
    assert await closed_by_server(reader)
    writer.close()

    reader, writer = await connect(bounded)
    writer.write(b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n")
    assert (await response_of(reader))[0] == 200
    writer.write(b"GET /hea")  # a kept-alive connection's next request has the same time
    assert await closed_by_server(reader)
    writer.close()

    reader, writer = await connect(bounded)
    writer.write(b"GET /health HTTP/1.1\r\nhost: gateway\r\nx-padding: " + b"a" * 70_000 + b"\r\n\r\n")
    status, _, body = await asyncio.wait_for(response_of(reader), 10)
    assert status == 431 and "64 KiB" in json.loads(body)["error"]["message"]
    assert await closed_by_server(reader)
    writer.close()


async def test_http_refuses_connections_past_max_concurrent_requests(settings: Settings) -> None:
    stack = await start_stack(settings.model_copy(update={"max_concurrent_requests": 2}))
    try:
        held = [await connect(stack) for _ in range(2)]
        async with httpx.AsyncClient(base_url=stack.http_url) as http:
            assert (await http.get("/health")).status_code == 503
            held[0][1].close()

            async def served() -> bool:
                return (await http.get("/health")).status_code == 200

            await eventually(served, what="a connection to come free")
        held[1][1].close()
    finally:
        await stop_stack(stack)


async def test_grpc_checks_the_key_before_parsing_the_message(bounded: Stack) -> None:
    generate = bounded.channel.unary_stream("/reflow.v1.Inference/Generate")  # bytes as they are
    garbage = b"\xff\xff\xff\xff"  # no message at all
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        async for _ in generate(garbage, metadata=UNKNOWN):
            pass
    assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as known:
        async for _ in generate(garbage, metadata=bounded.metadata):
            pass
    assert known.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in (known.value.details() or "")
    none = bounded.channel.stream_stream(
        "/reflow.v1.Inference/Generate"
    )  # a unary call's framing, no message
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        async for _ in none(iter(()), metadata=bounded.metadata):
            pass
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_grpc_messages_past_max_request_bytes_are_resource_exhausted(bounded: Stack) -> None:
    for prompt, code in (
        ("1" * (BOUND - 100), grpc.StatusCode.INVALID_ARGUMENT),  # read, then refused as too long a prompt
        ("1" * (BOUND + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),  # never read
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await bounded.stub.Generate(request(prompt=prompt), metadata=bounded.metadata).read()
        assert refused.value.code() == code


async def test_grpc_refuses_calls_past_max_concurrent_requests(settings: Settings) -> None:
    stack = await start_stack(settings.model_copy(update={"max_concurrent_requests": 1}))
    try:
        async with held_stream(stack):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.stub.ListModels(
                    inference_pb2.ListModelsRequest(), metadata=stack.metadata, timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await eventually(lambda: stack.metrics.in_flight._value.get() == 0, what="the held stream to end")
        await stack.stub.ListModels(inference_pb2.ListModelsRequest(), metadata=stack.metadata, timeout=10)
    finally:
        await stop_stack(stack)


async def test_unknown_keys_past_the_limit_are_refused_on_both_faces_without_a_lookup(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = await start_stack(settings.model_copy(update={"auth_failures_per_minute": 2}))
    lookups: list[str] = []

    def counted(engine: object, api_key: str) -> TenantInfo | None:
        lookups.append(api_key)
        return find_by_key(engine, api_key)  # type: ignore[arg-type]

    monkeypatch.setattr(auth_module, "find_by_key", counted)
    list_models = stack.stub.ListModels
    try:
        async with httpx.AsyncClient(base_url=stack.http_url) as http:
            known = {"authorization": f"Bearer {stack.api_key}"}
            assert (await http.get("/v1/models", headers=known)).status_code == 200
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await list_models(inference_pb2.ListModelsRequest(), metadata=guessed(1))
            assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await http.get("/v1/models", headers=dict(guessed(2)))).status_code == 401
            assert len(lookups) == 3  # the two faces' failures count together: that was the second
            limited = await http.get("/v1/models", headers=dict(guessed(3)))
            assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 59
            assert limited.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(grpc.aio.AioRpcError) as exhausted:
                await list_models(inference_pb2.ListModelsRequest(), metadata=guessed(4))
            assert exhausted.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert RETRY_PUSHBACK_KEY in dict(exhausted.value.trailing_metadata() or ())
            assert len(lookups) == 3
            # the tenant whose key is known keeps its service on both faces
            assert (await http.get("/v1/models", headers=known)).status_code == 200
            await list_models(inference_pb2.ListModelsRequest(), metadata=stack.metadata)
    finally:
        await stop_stack(stack)
