"""`reflow feedback stats`: what the store holds and how far the consumer is behind Kafka."""

from __future__ import annotations

import time
from typing import Any

from kafka import KafkaConsumer
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
        start = consumer.beginning_offsets(every)
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


def last_offsets(consumer: KafkaConsumer, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
    """The offset after the last record of each partition.

    Tansu answers ListOffsets(latest) with the start of the last batch plus one, not the end of the
    log, so the end is checked by reading from there: the fetch returns the whole last batch, and
    on Kafka, whose answer is exact, it returns just the last record.
    """
    reported = consumer.end_offsets(partitions)
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
