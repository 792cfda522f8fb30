"""SubmitFeedback and inference events through a real gateway, broker and store."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from feedback.bus.kafka import FEEDBACK_TOPIC, INFERENCES_TOPIC
from feedback.bus.publisher import Publisher
from feedback.intake.stats import store_counts
from feedback.training.dataset import build_dataset, count_new, load_new
from gateway.assignment import Assignment
from gateway.publishing import InferenceLog
from gateway.relay import Generation
from gateway.routing import ModelSpec
from gateway.tenants import TenantInfo, create_tenant
from reflow.kafka_settings import PublisherConfig
from reflow.request_ids import RequestIds
from reflow.settings import Settings
from reflow.store.database import open_db
from reflow.store.tables import Inference
from reflow.v1 import inference_pb2
from tests.support.kafka import Broker, consuming
from tests.support.stack import Stack, generate, request, start_stack, stop_stack
from tests.support.store import count
from tests.support.waiting import wait_for

P = inference_pb2


async def items(feedback: Iterable[P.Feedback]) -> AsyncIterator[P.Feedback]:
    for item in feedback:
        yield item


async def submit(stack: Stack, feedback: Iterable[P.Feedback], api_key: str | None = None) -> P.FeedbackAck:
    metadata = (("authorization", f"Bearer {api_key or stack.api_key}"),)
    return await stack.stub.SubmitFeedback(items(feedback), metadata=metadata)


async def completion(stack: Stack, prompt: str = "12+30=", api_key: str | None = None) -> str:
    """Generates one completion and returns its request_id."""
    metadata = (("authorization", f"Bearer {api_key or stack.api_key}"),)
    messages = [m async for m in stack.stub.Generate(request(prompt, max_tokens=6), metadata=metadata)]
    return messages[0].request_id


async def test_accepts_valid_items_and_says_why_each_other_one_was_rejected(
    stack: Stack, kafka: Broker
) -> None:
    request_id = await completion(stack)
    other_request = request_id[:-1] + ("0" if request_id[-1] != "0" else "1")  # a forged id
    ack = await submit(
        stack,
        [
            P.Feedback(
                feedback_id="fb-1", request_id=request_id, rating=1, user_id="u1", labels={"src": "ui"}
            ),
            P.Feedback(request_id=request_id, rating=-1, correction="42"),  # the gateway names it
            P.Feedback(feedback_id="fb-3", request_id=request_id, rating=5),
            P.Feedback(feedback_id="fb-4", rating=1),
            P.Feedback(feedback_id="fb-5", request_id=request_id, rating=0, correction="x" * 5000),
            P.Feedback(feedback_id="fb-6", request_id=other_request, rating=1),
            P.Feedback(request_id=request_id, rating=1, labels={str(i): "v" for i in range(17)}),
        ],
    )
    assert (ack.accepted, ack.rejected) == (2, 5)
    errors = {e.index: e for e in ack.errors}
    assert sorted(errors) == [2, 3, 4, 5, 6]
    assert "rating" in errors[2].reason and errors[2].feedback_id == "fb-3"
    assert "request_id" in errors[3].reason
    assert "correction" in errors[4].reason
    assert errors[5].code == "PERMISSION_DENIED" and "not served to this tenant" in errors[5].reason
    assert "labels" in errors[6].reason
    assert {e.code for i, e in errors.items() if i != 5} == {"INVALID_ARGUMENT"}

    stored = [json.loads(r.value) for r in kafka.read(FEEDBACK_TOPIC, 2)]
    assert {r["request_id"] for r in stored} == {request_id}
    assert {r["tenant"] for r in stored} == {"acme"}
    by_rating = {r["rating"]: r for r in stored}
    assert by_rating[1]["feedback_id"] == "fb-1" and by_rating[1]["labels"] == {"src": "ui"}
    assert by_rating[-1]["feedback_id"].startswith("fb_") and by_rating[-1]["correction"] == "42"
    assert stack.metrics.feedback.labels("rejected", "acme")._value.get() == 5


async def test_the_same_item_sent_twice_without_an_id_gets_the_same_id(stack: Stack, kafka: Broker) -> None:
    request_id = await completion(stack)
    item = P.Feedback(request_id=request_id, rating=-1, correction="42")
    await submit(stack, [item])
    await submit(stack, [item])
    ids = {json.loads(r.value)["feedback_id"] for r in kafka.read(FEEDBACK_TOPIC, 2)}
    assert len(ids) == 1


async def test_a_tenant_cannot_rate_another_tenants_completion(stack: Stack) -> None:
    _, other_key = create_tenant(open_db(stack.settings.resolved_database_url), "globex")
    theirs = await completion(stack, api_key=other_key)
    ours = await completion(stack)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await submit(stack, [P.Feedback(request_id=theirs, rating=-1)])
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "not served to this tenant" in info.value.details()
    assert (await submit(stack, [P.Feedback(request_id=theirs, rating=1)], api_key=other_key)).accepted == 1
    mixed = await submit(
        stack, [P.Feedback(request_id=theirs, rating=1), P.Feedback(request_id=ours, rating=1)]
    )
    assert (mixed.accepted, mixed.rejected, mixed.errors[0].index) == (1, 1, 0)
    # nor prefer their own answer over another tenant's (which would teach from it)
    preference = await submit(
        stack, [P.Feedback(request_id=ours, preferred_over=theirs), P.Feedback(request_id=ours, stars=5)]
    )
    assert (preference.accepted, preference.rejected) == (1, 1)
    assert preference.errors[0].code == "PERMISSION_DENIED"
    assert "preferred_over" in preference.errors[0].reason


async def test_a_stream_of_only_bad_items_fails_with_invalid_argument(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await submit(stack, [P.Feedback(request_id="", rating=1), P.Feedback(request_id="x", rating=9)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("item 0: request_id")
    assert "1 more item(s) rejected" in info.value.details()


async def test_a_stream_past_the_bound_is_refused_once_the_items_before_it_were_taken(
    settings: Settings, kafka: Broker
) -> None:
    """REFLOW_MAX_FEEDBACK_ITEMS counts items by position, rejected ones too: a client that would
    never stop sending is cut off there."""
    stack = await start_stack(settings.model_copy(update={"max_feedback_items": 3}))
    try:
        request_id = await completion(stack)
        taken = [
            P.Feedback(feedback_id="fb-1", request_id=request_id, rating=1),
            P.Feedback(feedback_id="fb-2", request_id=request_id, rating=9),  # rejected, yet counted
            P.Feedback(feedback_id="fb-3", request_id=request_id, rating=-1),
        ]
        endless = (
            P.Feedback(feedback_id=f"past-{i}", request_id=request_id, rating=1) for i in itertools.count()
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit(stack, itertools.chain(taken, endless))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at most 3 items" in info.value.details()
        assert "(2 accepted, 1 rejected)" in info.value.details()
        stored = kafka.read(FEEDBACK_TOPIC, 3, timeout_s=3)
        assert sorted(json.loads(r.value)["feedback_id"] for r in stored) == ["fb-1", "fb-3"]
        assert stack.metrics.feedback.labels("accepted", "acme")._value.get() == 2
    finally:
        await stop_stack(stack)


async def test_submit_feedback_needs_an_api_key(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stack.stub.SubmitFeedback(items([P.Feedback(request_id="x", rating=1)]))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_each_finished_generation_publishes_one_event(stack: Stack, kafka: Broker) -> None:
    messages = await generate(stack, request("12+30=", max_tokens=6, user_id="user-7"))
    (record,) = kafka.read(INFERENCES_TOPIC, 1)
    event = json.loads(record.value)
    first, last = messages[0], messages[-1]
    assert record.key == first.request_id.encode()
    assert (event["request_id"], event["tenant"], event["user_id"]) == (first.request_id, "acme", "user-7")
    assert (event["model"], event["version"], event["arm"]) == ("arith", "1", "champion")
    assert event["prompt"] == "12+30="
    assert event["completion"] == "".join(m.text for m in messages)
    assert event["reasoning"] == "".join(m.reasoning_text for m in messages)
    assert event["finish_reason"] == P.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
    assert event["usage"]["completion_tokens"] == last.usage.completion_tokens
    assert event["latency"]["total_ms"] == pytest.approx(last.usage.total_ms, rel=1e-5)


@pytest.fixture
def store_consumer(stack: Stack, kafka: Broker) -> Iterator[Engine]:
    db = open_db(stack.settings.resolved_database_url)
    with consuming(kafka.bootstrap, db):
        yield db


async def rate_new_completions(stack: Stack, n: int) -> None:
    request_ids = [await completion(stack, f"{i}+1=") for i in range(n)]
    ack = await submit(stack, [P.Feedback(request_id=r, rating=1) for r in request_ids])
    assert ack.accepted == n


async def test_nothing_is_lost_while_the_broker_is_down(
    stack: Stack, kafka: Broker, store_consumer: Engine
) -> None:
    await rate_new_completions(stack, 3)
    wait_for(lambda: store_counts(store_consumer)["joined_feedback"] == 3, what="the first ratings")
    kafka.stop()
    await rate_new_completions(stack, 4)  # served and acknowledged all the same
    # four ratings, and four inference events (handed over in the background), in the outbox
    await asyncio.to_thread(wait_for, lambda: stack.publisher.pending == 8, 10, "the outbox")
    kafka.start()
    everything = {"inferences": 7, "feedback": 7, "joined_feedback": 7}
    await asyncio.to_thread(wait_for, lambda: store_counts(store_consumer) == everything, 90, "all rows")
    assert stack.publisher.pending == 0


async def test_a_preference_and_stars_from_either_face_become_what_the_job_learns_from(
    stack: Stack, store_consumer: Engine
) -> None:
    """Two answers to one prompt, one preferred over HTTP; another rated in stars over gRPC."""
    first, second, starred = [await completion(stack, prompt) for prompt in ("12+30=", "12+30=", "1+1=")]
    headers = {"authorization": f"Bearer {stack.api_key}"}
    async with httpx.AsyncClient(base_url=stack.http_url, headers=headers) as http:
        preferred = await http.post("/v1/feedback", json={"request_id": second, "preferred_over": first})
    assert preferred.json()["accepted"] == 1, preferred.text
    ack = await submit(stack, [P.Feedback(request_id=starred, stars=2, user_id="ann")])
    assert (ack.accepted, ack.rejected) == (1, 0)

    await asyncio.to_thread(wait_for, lambda: count_new(store_consumer, "arith") == 2, 60, "both items")
    dataset = build_dataset(load_new(store_consumer, "arith", 10), 1e-9, lambda _prompt: None)
    ((pair,), (undesirable,)) = dataset.pairs, dataset.undesirable  # 2 stars: a thumbs down
    assert pair.chosen.prompt == pair.rejected.prompt == "12+30="
    assert undesirable.prompt == "1+1="


async def test_a_nul_in_the_text_does_not_fail_the_completion_and_its_event_is_storable(
    stack: Stack, kafka: Broker
) -> None:
    """Models may generate any byte and prompts may hold one; PostgreSQL text cannot hold NUL."""
    messages = await generate(stack, request("12\x00+30=", max_tokens=6))
    assert messages[-1].finish_reason in (P.FINISH_REASON_STOP, P.FINISH_REASON_LENGTH)
    (record,) = kafka.read(INFERENCES_TOPIC, 1)
    assert json.loads(record.value)["prompt"] == "12\ufffd+30="


def test_a_chat_completion_is_stored_with_its_whole_conversation(
    kafka: Broker, store: Engine, tmp_path: Path
) -> None:
    """The event of a chat completion, from the gateway's inference log to the store (the
    completion is made up here: the built-in model has no chat template to serve one)."""
    conversation = [
        P.ChatMessage(role="system", content="Add."),
        P.ChatMessage(role="user", content="12+\x0030="),
    ]
    request_id = RequestIds.from_store(store).new("acme")  # the consumer stores only what was served
    generation = Generation(
        P.GenerateRequest(messages=conversation), TenantInfo(1, "acme", 32, 600), request_id,
        Assignment(ModelSpec("arith", alias="champion"), "champion"), time.perf_counter(), None,
    )  # fmt: skip
    header = P.GenerateResponse(request_id=request_id, model="arith", model_version="1", arm="champion")
    last = P.GenerateResponse(finish_reason=P.FINISH_REASON_STOP, usage=P.Usage(prompt_tokens=20))
    settings = Settings(data_dir=tmp_path, kafka_handover_timeout_s=1.0)
    publisher = Publisher(kafka.bootstrap, settings.outbox_path, PublisherConfig.from_settings(settings))
    with consuming(kafka.bootstrap, store):
        InferenceLog(publisher, settings.max_event_bytes).finished(generation, header, last, "42", "")
        wait_for(lambda: count(store, Inference) == 1, what="the inference row")
    publisher.close(timeout_s=2.0)
    with Session(store) as session:
        row = session.get(Inference, request_id)
        assert row is not None
        assert (row.prompt, row.completion, row.finish_reason) == ("", "42", "STOP")
        assert row.messages == [
            {"role": "system", "content": "Add."},
            {"role": "user", "content": "12+\ufffd30="},  # PostgreSQL text cannot hold NUL
        ]
