"""`reflow feedback stats`: what the store holds and how far the consumer is behind Kafka."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kafka import KafkaConsumer
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from feedback.bus.kafka import (
    DLQ_TOPIC,
    FEEDBACK_TOPIC,
    INFERENCES_TOPIC,
    STORE_GROUP,
    new_admin,
    new_consumer,
)
from reflow.kafka_settings import KafkaSecurity
from reflow.store.tables import RATES, FeedbackItem, Inference


def store_counts(db: Engine) -> dict[str, int]:
    """Rows of inferences and feedback, and feedback joined with the completion it rates."""
    joined = select(func.count()).select_from(FeedbackItem).join(Inference, RATES)
    with Session(db) as session:
        return {
            "inferences": session.scalar(select(func.count()).select_from(Inference)) or 0,
            "feedback": session.scalar(select(func.count()).select_from(FeedbackItem)) or 0,
            "joined_feedback": session.scalar(joined) or 0,
        }


def kafka_stats(bootstrap: str, group_id: str = STORE_GROUP, *, security: KafkaSecurity) -> dict[str, Any]:
    """Records in the DLQ and, per partition, how many records the store consumer has yet to commit."""
    consumer = new_consumer(bootstrap, security=security, group_id=None)
    admin = new_admin(bootstrap, security=security)
    try:
        partitions = {
            topic: [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            for topic in (INFERENCES_TOPIC, FEEDBACK_TOPIC, DLQ_TOPIC)
        }
        every = [tp for tps in partitions.values() for tp in tps]
        end = last_offsets(consumer, every)
        start = listed_offsets(consumer.beginning_offsets, every)
        consumed = partitions[INFERENCES_TOPIC] + partitions[FEEDBACK_TOPIC]
        committed = admin.list_group_offsets({group_id: consumed}).get(group_id, {})
        lag = {}
        for tp in consumed:
            done = committed[tp].offset if tp in committed and committed[tp].offset >= 0 else start[tp]
            lag[f"{tp.topic}/{tp.partition}"] = max(end[tp] - done, 0)
        return {
            "dlq_messages": sum(end[tp] - start[tp] for tp in partitions[DLQ_TOPIC]),
            "consumer_lag": lag,
        }
    finally:
        consumer.close()
        admin.close()


def listed_offsets(
    list_offsets: Callable[[list[TopicPartition]], dict[TopicPartition, int]],
    partitions: list[TopicPartition],
    timeout_s: float = 5.0,
) -> dict[TopicPartition, int]:
    """What `list_offsets` (a consumer's beginning_offsets or end_offsets) answers for `partitions`.

    Where kafka-python (3.0) does not know a partition's leader yet, or the broker answered it no
    offset (a topic created a moment ago), it leaves the partition out of the broker's answer and
    then fails looking it up, with a KeyError naming it. That is asked again until `timeout_s`;
    then KafkaTimeoutError names the partition.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list_offsets(partitions)
        except KeyError as error:
            if time.monotonic() > deadline:
                raise KafkaTimeoutError(f"Kafka gave no offset for {error} in {timeout_s:g} s") from None
            time.sleep(0.1)


def last_offsets(consumer: KafkaConsumer, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
    """The offset after the last record of each partition.

    Tansu answers ListOffsets(latest) with the start of the last batch plus one, not the end of the
    log, so the end is checked by reading from there: the fetch returns the whole last batch, and
    on Kafka, whose answer is exact, it returns just the last record.
    """
    reported = listed_offsets(consumer.end_offsets, partitions)
    ends = dict(reported)
    consumer.assign([tp for tp in partitions if reported[tp] > 0])
    for tp in consumer.assignment():
        consumer.seek(tp, reported[tp] - 1)
    deadline = time.monotonic() + 5.0
    pending = set(consumer.assignment())
    while pending and time.monotonic() < deadline:
        for tp, records in consumer.poll(timeout_ms=200).items():
            ends[tp] = max(ends[tp], records[-1].offset + 1)
            pending.discard(tp)
    return ends
