"""The store consumer against a real broker and real databases (SQLite and PostgreSQL); every
request id is minted as the gateway mints them (signed for its tenant), except the forged ones."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from feedback.bus.kafka import DLQ_TOPIC, FEEDBACK_TOPIC, INFERENCES_TOPIC, Record
from feedback.events import FeedbackEvent, InferenceEvent, Latency, TokenUsage
from feedback.intake.consumer import StoreConsumer
from feedback.intake.stats import kafka_stats, store_counts
from reflow.kafka_settings import PLAINTEXT
from reflow.request_ids import RequestIds
from reflow.store.tables import FeedbackItem, Inference
from tests.support.cli import spawn
from tests.support.kafka import Broker, consuming, produce
from tests.support.store import count
from tests.support.waiting import wait_for

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def inference(request_id: str, tenant: str = "acme") -> InferenceEvent:
    return InferenceEvent(
        request_id=request_id, tenant=tenant, model="arith", version="1", arm="champion",
        prompt="12+30=", reasoning="2+0=2, 1+3=4", completion="42", finish_reason="STOP",
        usage=TokenUsage(prompt_tokens=7, completion_tokens=20, reasoning_tokens=14),
        latency=Latency(first_token_ms=3.5, total_ms=40.0), time=NOW,
    )  # fmt: skip


def feedback(feedback_id: str, request_id: str, rating: int = 1, tenant: str = "acme") -> FeedbackEvent:
    return FeedbackEvent(
        feedback_id=feedback_id, request_id=request_id, tenant=tenant, rating=rating, time=NOW
    )


@pytest.fixture
def running_consumer(kafka: Broker, store: Engine) -> Iterator[StoreConsumer]:
    with consuming(kafka.bootstrap, store) as consumer:
        yield consumer


def lag(kafka: Broker) -> int:
    return sum(kafka_stats(kafka.bootstrap, security=PLAINTEXT)["consumer_lag"].values())


def test_stores_each_event_once_and_joins_feedback_that_came_first(
    kafka: Broker, store: Engine, running_consumer: StoreConsumer
) -> None:
    ids = RequestIds.from_store(store)
    r1, r2, r9 = ids.new("acme"), ids.new("acme"), ids.new("mallory")
    early = feedback("f-early", r1, rating=-1)
    records = [
        early.to_record(),  # before the completion it rates
        inference(r1).to_record(),
        inference(r1).to_record(),  # redelivered
        early.to_record(),  # the same feedback_id again
        feedback("f-late", r1, rating=1).to_record(),
        inference(r2).to_record(),
        feedback("f-other", r9, tenant="mallory").to_record(),  # its completion never came: not joined
        feedback("f-early", r9, tenant="mallory").to_record(),  # ids are per tenant: no clash
    ]
    produce(kafka.bootstrap, records)
    wait_for(lambda: count(store, FeedbackItem) == 4 and count(store, Inference) == 2, what="all rows")
    assert store_counts(store) == {"inferences": 2, "feedback": 4, "joined_feedback": 2}
    with Session(store) as session:
        row = session.get(Inference, r1)
        assert row is not None
        assert (row.prompt, row.completion, row.reasoning_tokens, row.total_ms) == ("12+30=", "42", 14, 40.0)
        assert row.messages == []  # a prompt, not a conversation
        rows = session.execute(
            select(FeedbackItem.tenant, FeedbackItem.feedback_id, FeedbackItem.rating)
        ).all()
    assert {(t, f): r for t, f, r in rows} == {
        ("acme", "f-early"): -1,
        ("acme", "f-late"): 1,
        ("mallory", "f-other"): 1,
        ("mallory", "f-early"): 1,
    }
    wait_for(lambda: lag(kafka) == 0, what="lag 0")


def test_malformed_records_go_to_the_dlq_and_the_partition_moves_on(
    kafka: Broker, store: Engine, running_consumer: StoreConsumer
) -> None:
    r1 = RequestIds.from_store(store).new("acme")
    bad_rating = feedback("f-bad", r1).to_record().value.replace(b'"rating":1', b'"rating":7')
    nul = feedback("f-nul", r1).to_record().value.replace(b'"correction":""', b'"correction":"4\\u00002"')
    produce(
        kafka.bootstrap,
        [
            Record(FEEDBACK_TOPIC, r1.encode(), b"not json at all"),
            Record(FEEDBACK_TOPIC, r1.encode(), bad_rating),
            Record(FEEDBACK_TOPIC, r1.encode(), nul),  # PostgreSQL could never store it
            feedback("f-good", r1).to_record(),  # same key, so same partition: behind the bad ones
        ],
    )
    wait_for(lambda: count(store, FeedbackItem) == 1, what="the good record")
    dead = kafka.read(DLQ_TOPIC, 3)
    assert sorted(r.value for r in dead) == sorted([b"not json at all", bad_rating, nul])
    reasons = {r.value: dict(r.headers)["reason"].decode() for r in dead}
    assert "JSON" in reasons[b"not json at all"]
    assert "rating" in reasons[bad_rating]
    assert "NUL" in reasons[nul]
    assert all(dict(r.headers)["source"].startswith(f"{FEEDBACK_TOPIC}/".encode()) for r in dead)
    assert kafka_stats(kafka.bootstrap, security=PLAINTEXT)["dlq_messages"] == 3


def test_records_naming_a_request_not_served_to_their_tenant_go_to_the_dlq(
    kafka: Broker, store: Engine, running_consumer: StoreConsumer
) -> None:
    """Whoever can write to the topics cannot forge a tenant's feedback or completions: each
    request id is checked against the tenant it was signed for, as the gateway checks feedback."""
    ids = RequestIds.from_store(store)
    ours, other = ids.new("acme"), ids.new("acme")
    made_up = "0" * 48  # the shape of a request id, signed by nobody
    forged = [
        feedback("f-made-up", made_up).to_record(),
        feedback("f-stolen", ours, tenant="mallory").to_record(),  # acme's completion, rated as mallory
        FeedbackEvent(
            feedback_id="f-preferred", request_id=ours, preferred_over=made_up, tenant="acme", time=NOW
        ).to_record(),  # a preference over a completion acme was never served
        inference(other, tenant="mallory").to_record(),  # acme's request id, as mallory's completion
        inference(made_up).to_record(),
    ]
    genuine = [inference(ours).to_record(), feedback("f-real", ours).to_record()]
    produce(kafka.bootstrap, forged + genuine)
    wait_for(lambda: running_consumer.records == len(forged) + len(genuine), what="every record handled")
    with Session(store) as session:
        assert session.scalars(select(FeedbackItem.feedback_id)).all() == ["f-real"]
        assert session.scalars(select(Inference.request_id)).all() == [ours]
    dead = kafka.read(DLQ_TOPIC, len(forged))
    assert sorted(r.value for r in dead) == sorted(r.value for r in forged)
    reasons = [dict(r.headers)["reason"].decode() for r in dead]
    assert all(reason.startswith("forged: ") and "not served to" in reason for reason in reasons)
    sources = {dict(r.headers)["source"].decode().split("/")[0] for r in dead}
    assert sources == {FEEDBACK_TOPIC, INFERENCES_TOPIC}
    assert (running_consumer.dead, running_consumer.forged) == (len(forged), len(forged))


@pytest.mark.slow  # consumer processes killed and restarted over a large batch
def test_kill_9_in_the_middle_of_a_large_batch_loses_and_duplicates_nothing(
    kafka: Broker, database_url: str, store: Engine
) -> None:
    total = 20_000
    request_ids = [RequestIds.from_store(store).new("acme") for _ in range(500)]
    produce(kafka.bootstrap, [feedback(f"f{i}", request_ids[i % 500]).to_record() for i in range(total)])
    env = {
        "REFLOW_DATABASE_URL": database_url,
        "REFLOW_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "REFLOW_CONSUMER_BATCH_SIZE": "500",
    }
    command = ("feedback", "consume")
    first = spawn(*command, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: count(store, FeedbackItem) > 0, what="the first batches")
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        stored_when_killed = count(store, FeedbackItem)
        assert stored_when_killed < total, "the consumer finished before it could be killed"
    finally:
        first.kill()
    second = spawn(*command, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: count(store, FeedbackItem) >= total, what="every record")
        time.sleep(1.0)  # anything redelivered has been written (or skipped) by now
        with Session(store) as session:
            ids = session.scalars(select(FeedbackItem.feedback_id)).all()
        assert len(ids) == total and set(ids) == {f"f{i}" for i in range(total)}
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
