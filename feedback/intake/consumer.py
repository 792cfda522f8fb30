"""`reflow feedback consume`: the consumer group that writes inference events and feedback to the store.

Each batch is decoded (a malformed record goes to the dead-letter topic with the reason, and the
partition moves on), checked (a record naming a request that was not served to its tenant is
forged, since request ids are signed for their tenant: it goes to the dead-letter topic too),
written in one database transaction that skips rows already stored (same request_id or
feedback_id), and only then are the offsets committed. A crash at any point therefore redelivers
records rather than losing them, and a redelivered record stores nothing twice.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import TopicPartition
from sqlalchemy import Connection, Engine, FromClause
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

from feedback.bus.kafka import (
    DLQ_TOPIC,
    FEEDBACK_TOPIC,
    INFERENCES_TOPIC,
    STORE_GROUP,
    new_consumer,
    new_producer,
)
from feedback.events import FeedbackEvent, InferenceEvent, NotYourRequest, Routing, decode, require_served
from reflow.kafka_settings import KafkaSecurity
from reflow.request_ids import RequestIds
from reflow.store.tables import FeedbackItem, Inference, utcnow

logger = logging.getLogger(__name__)
RETRY_S = 1.0  # pause before retrying a batch the store or the DLQ refused

Batch = dict[TopicPartition, list[ConsumerRecord]]


def inference_row(event: InferenceEvent, stored_at: datetime) -> dict[str, Any]:
    """The `inferences` row of an event."""
    return {
        "request_id": event.request_id, "tenant": event.tenant, "user_id": event.user_id,
        "model": event.model, "version": event.version, "arm": event.arm,
        "experiment_id": event.experiment, "prompt": event.prompt,
        "messages": [message.model_dump() for message in event.messages or ()],
        "reasoning": event.reasoning, "completion": event.completion,
        "finish_reason": event.finish_reason, "prompt_tokens": event.usage.prompt_tokens,
        "completion_tokens": event.usage.completion_tokens,
        "reasoning_tokens": event.usage.reasoning_tokens,
        "first_token_ms": event.latency.first_token_ms, "total_ms": event.latency.total_ms,
        "created_at": event.time, "stored_at": stored_at, "truncated": bool(event.truncated),
        **routing_columns(event.routing),
    }  # fmt: skip


def routing_columns(routing: Routing | None) -> dict[str, Any]:
    """The `inferences` columns of how a generation was placed; their defaults where it was not."""
    if routing is None:
        return {}
    return {
        "variant": routing.variant, "latency_budget_ms": routing.latency_budget_ms,
        "predicted_total_ms": routing.predicted_total_ms, "reasoning_budget": routing.reasoning_budget,
    }  # fmt: skip


def feedback_row(event: FeedbackEvent, stored_at: datetime) -> dict[str, Any]:
    """The `feedback` row of an event."""
    return {
        "feedback_id": event.feedback_id, "request_id": event.request_id, "tenant": event.tenant,
        "rating": event.rating, "correction": event.correction, "user_id": event.user_id,
        "labels": dict(event.labels), "preferred_over": event.preferred_over or "", "stars": event.stars or 0,
        "created_at": event.time, "stored_at": stored_at,
    }  # fmt: skip


def insert_new(connection: Connection, table: FromClause, rows: Iterable[dict[str, Any]]) -> None:
    """Inserts the rows whose unique keys are not stored yet (SQLite and PostgreSQL)."""
    rows = list(rows)
    if rows:
        dialect = {"postgresql": postgresql, "sqlite": sqlite}[connection.dialect.name]
        connection.execute(dialect.insert(table).on_conflict_do_nothing(), rows)


def store_events(connection: Connection, events: Iterable[InferenceEvent | FeedbackEvent]) -> None:
    """Writes events as rows in one go, skipping those already stored (and repeats among them)."""
    now = utcnow()  # one stored_at per batch: the column default would call the clock per row
    inferences: dict[str, dict[str, Any]] = {}
    feedback: dict[tuple[str, str], dict[str, Any]] = {}
    for event in events:
        if isinstance(event, InferenceEvent):
            inferences[event.request_id] = inference_row(event, now)
        else:
            feedback[(event.tenant, event.feedback_id)] = feedback_row(event, now)
    insert_new(connection, Inference.__table__, inferences.values())
    insert_new(connection, FeedbackItem.__table__, feedback.values())


def forgery(event: InferenceEvent | FeedbackEvent, request_ids: RequestIds) -> str | None:
    """Why `event` is forged: it names a request that was not served to its tenant; None when
    every request it names was."""
    if isinstance(event, FeedbackEvent):
        try:
            require_served(event, request_ids.served_to)
        except NotYourRequest as error:
            return f"forged: {error}"
        return None
    if not request_ids.served_to(event.request_id, event.tenant):
        return f"forged: request {event.request_id!r} was not served to tenant {event.tenant!r}"
    return None


class StoreConsumer:
    """Moves records from reflow.inferences and reflow.feedback into the store, exactly once."""

    def __init__(
        self,
        bootstrap: str,
        db: Engine,
        batch_size: int,
        group_id: str = STORE_GROUP,
        *,
        security: KafkaSecurity,
    ):
        self.db = db
        self.batch_size = batch_size
        self.request_ids = RequestIds.from_store(db)  # what tells a forged record
        self.consumer: KafkaConsumer = new_consumer(
            bootstrap, INFERENCES_TOPIC, FEEDBACK_TOPIC, security=security, group_id=group_id,
            max_poll_records=batch_size,
        )  # fmt: skip
        self.dlq: KafkaProducer = new_producer(bootstrap, security=security)
        self.records = 0  # records this process stored or dead-lettered
        self.dead = 0  # records it sent to the DLQ
        self.forged = 0  # of those, records naming a request not served to their tenant

    def run(self, stop: threading.Event, drain_s: float = 0.0) -> None:
        """Polls and stores until `stop` is set; then, for up to `drain_s`, until caught up (so
        what the gateway sent before stopping is stored, not left in a memory-only broker)."""
        try:
            while not stop.is_set():
                batch = self.consumer.poll(timeout_ms=500, max_records=self.batch_size)
                if batch and not self.process(batch):
                    stop.wait(RETRY_S)
            deadline = time.monotonic() + drain_s
            while time.monotonic() < deadline:
                batch = self.consumer.poll(timeout_ms=500, max_records=self.batch_size)
                if not batch or not self.process(batch):
                    break
        finally:
            self.consumer.close()
            self.dlq.close(timeout=5.0)

    def process(self, batch: Batch) -> bool:
        """Stores one polled batch and commits its offsets; False (and rewound) when it must be retried."""
        decoded: list[tuple[ConsumerRecord, InferenceEvent | FeedbackEvent]] = []
        dead: list[tuple[ConsumerRecord, str]] = []
        forged = 0
        for records in batch.values():
            for record in records:
                try:
                    event = decode(record.topic, record.value)
                except ValueError as error:
                    dead.append((record, str(error)))
                    continue
                if (reason := forgery(event, self.request_ids)) is not None:
                    dead.append((record, reason))
                    forged += 1
                else:
                    decoded.append((record, event))
        try:
            try:
                with self.db.begin() as connection:
                    store_events(connection, [event for _, event in decoded])
            except (DataError, IntegrityError):  # one record the database refuses: find it
                dead += self._store_one_by_one(decoded)
            self._dead_letter(dead)
        except (SQLAlchemyError, KafkaError) as error:  # the store or Kafka is down: retry it all
            logger.error("could not store a batch (%s); retrying it in %.0fs", type(error).__name__, RETRY_S)
            for partition, records in batch.items():
                self.consumer.seek(partition, records[0].offset)
            return False
        count = sum(len(records) for records in batch.values())
        self.records += count
        self.dead += len(dead)
        self.forged += forged
        try:
            self.consumer.commit()
        except (CommitFailedError, KafkaError) as error:  # a rebalance: the next owner redelivers
            logger.warning("offset commit failed (%s); the batch will be redelivered and skipped", error)
        logger.debug("stored %d records, %d of them to the DLQ", count, len(dead))
        return True

    def _store_one_by_one(
        self, decoded: list[tuple[ConsumerRecord, InferenceEvent | FeedbackEvent]]
    ) -> list[tuple[ConsumerRecord, str]]:
        """Stores each event in its own transaction; returns the ones the database refused."""
        refused = []
        for record, event in decoded:
            try:
                with self.db.begin() as connection:
                    store_events(connection, [event])
            except (DataError, IntegrityError) as error:
                refused.append((record, f"the store refused it: {type(error.orig).__name__}: {error.orig}"))
        return refused

    def _dead_letter(self, dead: list[tuple[ConsumerRecord, str]]) -> None:
        """Sends malformed and forged records to the DLQ with why and where from; returns once acked."""
        futures = []
        for record, reason in dead:
            logger.warning(
                "record %s/%d@%d to the DLQ: %s", record.topic, record.partition, record.offset, reason
            )
            headers = [
                ("reason", reason.encode()),
                ("source", f"{record.topic}/{record.partition}/{record.offset}".encode()),
            ]
            futures.append(
                self.dlq.send(DLQ_TOPIC, key=record.key, value=record.value or b"", headers=headers)
            )
        for future in futures:
            future.get(timeout=30)


def consume(
    bootstrap: str,
    db: Engine,
    batch_size: int,
    stop: threading.Event,
    drain_s: float,
    *,
    security: KafkaSecurity,
) -> StoreConsumer:
    """Runs a store consumer until `stop` and drained; returns it (with its counts) once it left the group."""
    started = time.monotonic()
    consumer = StoreConsumer(bootstrap, db, batch_size, security=security)
    logger.info(
        "consuming %s and %s from %s (%s) into the store",
        INFERENCES_TOPIC, FEEDBACK_TOPIC, bootstrap, security.protocol,
    )  # fmt: skip
    consumer.run(stop, drain_s)
    logger.info(
        "consumer stopped after %.0fs: %d records stored, %d of them to the DLQ (%d forged)",
        time.monotonic() - started, consumer.records, consumer.dead, consumer.forged,
    )  # fmt: skip
    return consumer
