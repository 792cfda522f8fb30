"""Hostile input at the gateway's edge, drawn by hypothesis: every public RPC (Inference, Health and
reflection) gets well-typed messages with extreme values and bytes that are no message at all,
under odd metadata; every HTTP endpoint gets malformed bodies, headers, paths and methods. The
answer is always OK or a client error with a message (never INTERNAL, UNKNOWN or a 5xx), and the
gateway keeps serving.

Examples are derandomized (the suite must not fail on a new draw); to explore, raise EXAMPLES and
turn `derandomize` off. schemathesis covers what the OpenAPI document describes
(test_openapi_fuzz.py); this covers what no document does."""

from __future__ import annotations

import json
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from gateway.http.schemas import ChatCompletionRequest, CompletionRequest, FeedbackItem
from gateway.http.schemas import ChatMessage as HttpChatMessage
from reflow.settings import Settings
from reflow.v1 import inference_pb2
from tests.support import hostile
from tests.support.stack import Stack
from tests.support.threaded import StackThread, tiny_chat_settings

P = inference_pb2
pytestmark = pytest.mark.slow

EXAMPLES = 40  # per strategy: the file takes about a minute, well under a tenant's 600 requests a minute
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
    suppress_health_check=list(HealthCheck),  # slow draws, large data, a fixture reused: a network test
)  # fmt: skip
CALL_TIMEOUT_S = 30.0  # a call still open by then hung: DEADLINE_EXCEEDED, which fails the test

SERVICES: list[Any] = [  # ServiceDescriptors
    inference_pb2.DESCRIPTOR.services_by_name["Inference"],
    health_pb2.DESCRIPTOR.services_by_name["Health"],
    reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
]
METHODS = {f"/{s.full_name}/{m.name}": m for s in SERVICES for m in s.methods}
# In grpc's health.proto, but grpcio-health-checking (1.85) serves no List: UNIMPLEMENTED
HEALTH_LIST = "/grpc.health.v1.Health/List"
UNSERVED = {HEALTH_LIST: METHODS.pop(HEALTH_LIST)}
# Statuses that tell the client what to change (DEADLINE_EXCEEDED too, where the request set a
# latency budget shorter than the call's own deadline)
CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}  # fmt: skip


@dataclass
class Edge:
    """A gateway serving from a thread of its own, and a blocking channel to it: the asyncio client
    reports INTERNAL ("Internal error from Core") for a client stream the server ended early, e.g.
    at a message over its size limit, where the server answered RESOURCE_EXHAUSTED."""

    running: StackThread
    channel: grpc.Channel

    @property
    def stack(self) -> Stack:
        return self.running.stack


@pytest.fixture
def gateway(settings: Settings, chat_checkpoint: Path, tmp_path: Path) -> Iterator[Edge]:
    """The tiny chat model (a 128-token context: any max_tokens is generated or refused in
    milliseconds) behind a gateway, for blocking hypothesis tests."""
    running = StackThread(tiny_chat_settings(settings, chat_checkpoint, tmp_path))
    with grpc.insecure_channel(running.stack.address) as channel:
        yield Edge(running, channel)
    running.stop()


# gRPC


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: list[bytes]


def call(edge: Edge, path: str, requests: list[bytes], metadata: Any = None) -> Outcome:
    """Calls `path` with raw `requests` (one, or a stream of them) and the tenant's key unless
    `metadata` says otherwise; a server stream that stays open (Health.Watch) is read to its first
    reply and cancelled."""
    method = METHODS.get(path) or UNSERVED[path]
    streams = (method.client_streaming, method.server_streaming)
    multicallable = getattr(edge.channel, "_".join("stream" if s else "unary" for s in streams))(path)
    payload = iter(requests) if method.client_streaming else requests[0]  # bytes as they are
    metadata = edge.stack.metadata if metadata is None else metadata
    replies: list[bytes] = []
    try:
        if not method.server_streaming:
            replies.append(multicallable(payload, metadata=metadata, timeout=CALL_TIMEOUT_S))
        else:
            stream = multicallable(payload, metadata=metadata, timeout=CALL_TIMEOUT_S)
            for reply in stream:
                replies.append(reply)
                if method.name == "Watch":
                    stream.cancel()
                    break
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        return Outcome(error.code(), error.details() or "", replies)
    return Outcome(grpc.StatusCode.OK, "", replies)


def assert_ok_or_client_error(outcome: Outcome, path: str, budget_ms: int = 0) -> None:
    """OK, or a status the client can act on with a message saying how; DEADLINE_EXCEEDED only for
    a latency budget (`budget_ms`) shorter than the call's deadline."""
    if outcome.code == grpc.StatusCode.OK:
        return
    allowed = CLIENT_ERRORS | (
        {grpc.StatusCode.DEADLINE_EXCEEDED} if 0 < budget_ms < CALL_TIMEOUT_S * 1000 else set()
    )
    assert outcome.code in allowed, f"{path}: {outcome.code.name}: {outcome.details}"
    # the health protocol's NOT_FOUND (a service it does not know) is the whole answer
    if (path, outcome.code) != ("/grpc.health.v1.Health/Check", grpc.StatusCode.NOT_FOUND):
        assert outcome.details.strip(), f"{path}: {outcome.code.name} without a message"


def assert_generated(replies: list[bytes]) -> None:
    """A whole Generate stream: the first message names where it ran, the last how it ended."""
    messages = [P.GenerateResponse.FromString(r) for r in replies]
    assert messages and messages[0].request_id and messages[0].model_version
    assert messages[-1].finish_reason in (P.FINISH_REASON_STOP, P.FINISH_REASON_LENGTH)
    assert not any(m.finish_reason for m in messages[:-1])


def ordinary_request() -> P.GenerateRequest:
    return P.GenerateRequest(prompt="1+1=", sampling=P.SamplingParams(max_tokens=4))


def assert_still_serving(edge: Edge) -> None:
    """Health says SERVING for the server and the Inference service; an ordinary completion, over
    gRPC and over HTTP, is served whole."""
    for service in ("", "reflow.v1.Inference"):
        check = call(
            edge, "/grpc.health.v1.Health/Check", [serialized(health_pb2.HealthCheckRequest(service=service))]
        )
        assert check.code == grpc.StatusCode.OK, check.details
        status = health_pb2.HealthCheckResponse.FromString(check.replies[0]).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    generated = call(edge, "/reflow.v1.Inference/Generate", [serialized(ordinary_request())])
    assert generated.code == grpc.StatusCode.OK, generated.details
    assert_generated(generated.replies)
    with http_client(edge) as http:
        assert http.get("/health").status_code == 200
        completion = http.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 4})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["finish_reason"] in ("stop", "length")


def served_request_id(edge: Edge) -> str:
    """The id of a completion served to the test's tenant, to rate with feedback."""
    generated = call(edge, "/reflow.v1.Inference/Generate", [serialized(ordinary_request())])
    return P.GenerateResponse.FromString(generated.replies[0]).request_id


def serialized(message: Message) -> bytes:
    return message.SerializeToString()


def bases(request_id: str) -> dict[str, Message]:
    """A valid message of each request type, parts of which hostile values replace, so that a draw
    gets past the first check."""
    return {
        "reflow.v1.GenerateRequest": ordinary_request(),
        "reflow.v1.ChatMessage": P.ChatMessage(role="user", content="Hi"),
        "reflow.v1.SamplingParams": P.SamplingParams(max_tokens=4),
        "reflow.v1.Feedback": P.Feedback(request_id=request_id, rating=1),
        "grpc.health.v1.HealthCheckRequest": health_pb2.HealthCheckRequest(service="reflow.v1.Inference"),
        "grpc.reflection.v1alpha.ServerReflectionRequest":
            reflection_pb2.ServerReflectionRequest(list_services=""),
    }  # fmt: skip


def request_streams(
    method: MethodDescriptor, items: st.SearchStrategy[bytes], small_items: st.SearchStrategy[bytes]
) -> st.SearchStrategy[list[bytes]]:
    """What a call of `method` sends: one request, or for a client stream none, a few, or thousands
    of small ones."""
    if not method.client_streaming:
        return items.map(lambda item: [item])
    many = st.builds(
        operator.mul, st.lists(small_items, min_size=1, max_size=2), st.sampled_from(hostile.MANY)
    )
    return st.lists(items, max_size=4) | many


def budget_of(path: str, requests: list[bytes]) -> int:
    """The latency_budget_ms of a Generate request (0 for anything else, or no message)."""
    if not path.endswith("/Generate") or not requests:
        return 0
    try:
        return P.GenerateRequest.FromString(requests[0]).latency_budget_ms
    except DecodeError:
        return 0


def fuzz_rpc(edge: Edge, path: str, requests: st.SearchStrategy[list[bytes]]) -> None:
    """Calls `path` with each draw of `requests`: OK (a whole stream for Generate) or a client error."""

    @FUZZ
    @given(requests=requests)
    def answers_clearly(requests: list[bytes]) -> None:
        first = requests[0][:200] if requests else b""
        note(f"{len(requests)} message(s) of {sorted({len(r) for r in requests})} bytes, the first {first!r}")
        outcome = call(edge, path, requests)
        assert_ok_or_client_error(outcome, path, budget_of(path, requests))
        if path.endswith("/Generate") and outcome.code == grpc.StatusCode.OK:
            assert_generated(outcome.replies)

    answers_clearly()


def test_every_rpc_answers_hostile_messages_with_ok_or_a_client_error(gateway: Edge) -> None:
    """Well-typed messages with hostile values (drawn from their descriptors: a new field is fuzzed
    too), and bytes that are no such message."""
    assert set(METHODS) >= {
        "/reflow.v1.Inference/Generate", "/reflow.v1.Inference/SubmitFeedback",
        "/reflow.v1.Inference/ListModels", "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    }  # fmt: skip
    valid = bases(served_request_id(gateway))
    conversation = P.GenerateRequest(
        messages=[P.ChatMessage(role="user", content="Hi")], sampling=ordinary_request().sampling
    )
    for path, method in METHODS.items():
        request_bases = [valid]
        if path.endswith("/Generate"):  # a prompt or a conversation
            request_bases.append({**valid, method.input_type.full_name: conversation})
        typed = st.one_of([hostile.messages(method.input_type, b) for b in request_bases])
        small = st.one_of([hostile.messages(method.input_type, b, small=True) for b in request_bases])
        fuzz_rpc(gateway, path, request_streams(method, typed.map(serialized), small.map(serialized)))
        undecodable = hostile.undecodable(method.input_type, valid)
        fuzz_rpc(gateway, path, request_streams(method, undecodable, undecodable))
    assert call(gateway, HEALTH_LIST, [b""]).code == grpc.StatusCode.UNIMPLEMENTED, "List is served: fuzz it"
    assert_still_serving(gateway)


def authorizations(api_key: str) -> st.SearchStrategy[str]:
    """`authorization` values: empty, another scheme, the key with odd spacing or a character more
    or less, printable ASCII of any length (past gRPC's 16 KiB metadata limit too)."""
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=64)
    odd_keys = [api_key, f"Basic {api_key}", f"Bearer  {api_key}", f"BEARER {api_key} ", f"Bearer {api_key}x",
                f"Bearer {api_key[:-1]}", f"Bearer {api_key} {api_key}"]  # fmt: skip
    return st.one_of(
        st.sampled_from(["", "Bearer", "Bearer ", "bearer", "Basic dXNlcjpwYXNz", *odd_keys]),
        printable, printable.map(lambda t: f"Bearer {t}"),
        st.sampled_from([1000, 20_000]).map(lambda n: "Bearer " + "k" * n),
    )  # fmt: skip


def metadata(api_key: str) -> st.SearchStrategy[list[tuple[str, str | bytes]]]:
    """Call metadata: no, one or more `authorization` entries, binary (`-bin`) ones with any bytes
    (an `authorization-bin` too), and other keys."""
    names = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12).filter(
        lambda n: not n.startswith("grpc-") and not n.endswith("-bin")
    )
    entries = st.one_of(
        st.tuples(st.just("authorization"), authorizations(api_key)),
        st.tuples(st.sampled_from(["authorization-bin", "x-fuzz-bin"]), st.binary(max_size=64)),
        st.tuples(names, st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=32)),
    )
    return st.lists(entries, max_size=3)


def test_odd_metadata_is_refused_by_name_and_never_breaks_a_call(gateway: Edge) -> None:
    api_key = gateway.stack.api_key
    valid = bases(served_request_id(gateway))
    requests = {
        "/reflow.v1.Inference/Generate": [serialized(ordinary_request())],
        "/reflow.v1.Inference/SubmitFeedback": [serialized(valid["reflow.v1.Feedback"])],
        "/reflow.v1.Inference/ListModels": [serialized(P.ListModelsRequest())],
        "/grpc.health.v1.Health/Check": [serialized(health_pb2.HealthCheckRequest())],
    }

    @FUZZ
    @given(path=st.sampled_from(sorted(requests)), entries=metadata(api_key))
    def answers_clearly(path: str, entries: list[tuple[str, str | bytes]]) -> None:
        outcome = call(gateway, path, requests[path], tuple(entries))
        assert_ok_or_client_error(outcome, path)
        if path.startswith("/reflow.") and outcome.code == grpc.StatusCode.OK:  # the key, and only it
            first = next(v for k, v in entries if k == "authorization")
            assert (
                isinstance(first, str)
                and first.split()[0].lower() == "bearer"
                and first.split()[1:] == [api_key]
            )

    answers_clearly()
    # Text metadata must be printable ASCII (no tab either): gRPC's Python client refuses anything
    # else itself, before a byte is sent, so no such value reaches the gateway from Python.
    for value in ("Bearer é", "Bearer \x00", "Bearer \x7f", "Bearer a\nb", "Bearer \t"):
        path = "/reflow.v1.Inference/ListModels"
        refused = call(gateway, path, requests[path], (("authorization", value),))
        assert (refused.code, refused.details) == (grpc.StatusCode.INTERNAL, "Invalid metadata"), refused
    assert_still_serving(gateway)


# HTTP


def http_client(edge: Edge) -> httpx.Client:
    authorization = {"authorization": f"Bearer {edge.stack.api_key}"}
    return httpx.Client(base_url=edge.stack.http_url, headers=authorization, timeout=CALL_TIMEOUT_S)


def assert_http_answer(response: httpx.Response, sent: Any = None) -> None:
    """A success, or a 4xx in OpenAI's error shape; a 5xx only as the 504 of a latency budget the
    request (`sent`, when it was JSON) itself set."""
    status = response.status_code
    if status == 504:
        budget = sent.get("latency_budget_ms") if isinstance(sent, dict) else None
        assert isinstance(budget, int) and budget > 0, response.text
    else:
        assert status < 500, f"{status}: {response.text[:500]}"
    if status >= 400:
        assert response.headers.get("content-type") == "application/json", f"{status}: {response.text[:500]}"
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), body
        assert isinstance(error["type"], str) and isinstance(error["code"], str), body
        assert error["param"] is None or isinstance(error["param"], str), body
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"internal"' not in response.text, response.text


def parsed(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


CONTENT_TYPES = [
    "application/json", "application/json; charset=utf-8", "application/json; charset=latin-1",
    "APPLICATION/JSON", "application/json;;;", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "*/*", "application/x-ndjson", "application/jsonl", "",
]  # fmt: skip


def body_bytes(objects: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Bodies: hostile JSON (NaN and deep nesting included; mostly objects, as a body must be), cut
    short or followed by junk, in UTF-16, with bytes that are not UTF-8, or no JSON at all."""
    text = (objects | objects | hostile.json_values()).map(hostile.dumps)
    return st.one_of(
        text.map(str.encode),
        text.map(str.encode),  # twice as likely: the form that gets furthest
        st.builds(lambda t, k: t.encode()[: max(len(t) - k, 0)], text, st.integers(1, 8)),
        text.map(lambda t: t.encode() + b"}{\x00"),
        text.map(lambda t: t.encode("utf-16")),
        st.builds(lambda t, junk: t.encode() + junk, text, st.sampled_from(hostile.BAD_UTF8)),
        st.binary(max_size=64),
    )


def completion_bodies(model: type[Any], base: dict[str, Any]) -> st.SearchStrategy[Any]:
    """`base` with any of `model`'s fields hostile, and for chat its message's."""
    objects = hostile.mutated_objects(base, list(model.model_fields))
    if "messages" not in base:
        return objects
    message = hostile.mutated_objects(base["messages"][0], list(HttpChatMessage.model_fields))
    return objects | message.map(lambda m: {**base, "messages": [m]})


def fuzz_post(http: httpx.Client, path: str, bodies: st.SearchStrategy[bytes]) -> None:
    @FUZZ
    @given(body=bodies, content_type=st.just("application/json") | st.sampled_from(CONTENT_TYPES))
    def answers_clearly(body: bytes, content_type: str) -> None:
        note(f"{content_type}: {body[:300]!r}")
        response = http.post(path, content=body, headers={"content-type": content_type})
        assert_http_answer(response, parsed(body))

    answers_clearly()


def test_every_endpoint_answers_malformed_bodies_with_a_client_error(gateway: Edge) -> None:
    item = {"request_id": served_request_id(gateway), "rating": 1}
    items = hostile.mutated_objects(item, list(FeedbackItem.model_fields))
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    small_lines = st.one_of(
        st.sampled_from([b"", b"   ", b"{", b"[]", b"null", b"{}", b"\xff\xfe", b"\x00", b'{"rating": 1}\r']),
        st.binary(max_size=16).filter(lambda b: b"\n" not in b),
        st.just(hostile.dumps(item).encode()),
    )  # fmt: skip
    lines = st.one_of(
        small_lines, items.map(hostile.dumps).map(str.encode),
        st.sampled_from([100, 100_000]).map(lambda n: b"[" * n + b"]" * n),
    )  # fmt: skip
    many_lines = st.builds(
        operator.mul, st.lists(small_lines, min_size=1, max_size=3), st.sampled_from(hostile.MANY)
    )
    with http_client(gateway) as http:
        fuzz_post(
            http,
            "/v1/completions",
            body_bytes(completion_bodies(CompletionRequest, {"prompt": "1+1=", "max_tokens": 4})),
        )
        fuzz_post(http, "/v1/chat/completions", body_bytes(completion_bodies(ChatCompletionRequest, chat)))
        fuzz_post(http, "/v1/feedback", body_bytes(items | st.lists(items, max_size=4)))

        @FUZZ
        @given(
            lines=st.lists(lines, max_size=6) | many_lines,
            content_type=st.sampled_from(["application/x-ndjson", "application/jsonl", "application/json"]),
        )
        def answers_ndjson_clearly(lines: list[bytes], content_type: str) -> None:
            body = b"\n".join(lines)
            response = http.post("/v1/feedback", content=body, headers={"content-type": content_type})
            assert_http_answer(response)

        answers_ndjson_clearly()
    assert_still_serving(gateway)


PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/chat", "/v1/feedback",
         "/health", "/openapi.json"]  # fmt: skip


def header_values(api_key: str) -> st.SearchStrategy[bytes]:
    """Header values as bytes on the wire: latin-1 bytes past ASCII (HTTP's obs-text), an odd key,
    a huge one. HTTP allows no control byte but tab, nor DEL, nor whitespace at either end: uvicorn
    answers those itself, before the app, with a plain-text 400 "Invalid HTTP request received."."""
    odd = st.binary(max_size=32).map(lambda b: bytes(c for c in b if (c >= 0x20 and c != 0x7F) or c == 0x09))
    key = api_key.encode()
    return st.one_of(
        odd, odd.map(lambda b: b"Bearer " + b), odd.map(lambda b: b"Bearer " + key + b),
        st.sampled_from([b"", b"Bearer", b"Bearer \xe9\xff", b"Bearer " + key + b"\xa0", b"Bearer \xe9" + key,
                         b"\xc3\xa9", b"Bearer " + b"k" * 4000]),
    ).map(lambda b: b.strip(b" \t"))  # fmt: skip


def test_every_endpoint_answers_odd_headers_paths_and_methods_with_a_client_error(gateway: Edge) -> None:
    api_key = gateway.stack.api_key
    model_ids = st.one_of(
        st.text(max_size=16), st.binary(max_size=8).map(lambda b: "".join(f"%{c:02x}" for c in b)),
        st.sampled_from(["chat", "chat@champion", "chat/1", "chat/99999999999999999999", "%00", "..%2f..",
                         "x" * 5000]),
    )  # fmt: skip

    with httpx.Client(timeout=CALL_TIMEOUT_S) as http:

        @FUZZ
        @given(
            path=st.sampled_from(PATHS) | model_ids.map(lambda m: f"/v1/models/{m}"),
            method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
            authorization=header_values(api_key),
            content_type=header_values(api_key)
            | st.sampled_from([b"application/json", b"application/x-ndjson"]),
        )
        def answers_clearly(path: str, method: str, authorization: bytes, content_type: bytes) -> None:
            body = b'{"prompt": "1+1=", "max_tokens": 4}' if method in ("POST", "PUT", "PATCH") else b""
            headers = {b"authorization": authorization, b"content-type": content_type}
            note(f"{method} {path} with {headers}")
            try:
                url = httpx.URL(gateway.stack.http_url + path)
            except httpx.InvalidURL:
                return  # no URL httpx sends
            assert_http_answer(http.request(method, url, content=body, headers=headers))

        answers_clearly()
    assert_still_serving(gateway)
