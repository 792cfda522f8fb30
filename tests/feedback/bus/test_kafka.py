"""The client settings pinned in feedback/bus/kafka.py, against the embedded broker."""

from __future__ import annotations

import time

from kafka.structs import TopicPartition

from feedback.bus.kafka import (
    FEEDBACK_TOPIC,
    INFERENCES_TOPIC,
    TOPICS,
    ensure_topics,
    new_admin,
    new_consumer,
)
from reflow.kafka_settings import PLAINTEXT
from tests.support.kafka import Broker


def test_topics_are_created_once_with_the_configured_partitions() -> None:
    broker = Broker(partitions=5)
    broker.start()  # creates the topics
    try:
        ensure_topics(broker.bootstrap, partitions=2, security=PLAINTEXT)  # already there: left alone
        admin = new_admin(broker.bootstrap, security=PLAINTEXT)
        described = {t["name"]: len(t["partitions"]) for t in admin.describe_topics(list(TOPICS))}
        admin.close()
        assert described == dict.fromkeys(TOPICS, 5)
    finally:
        broker.stop()


def test_a_consumer_group_gets_every_partition_within_seconds(kafka: Broker) -> None:
    """Without the pinned protocol version kafka-python 3.x never gets partitions from Tansu;
    without the short session it takes ~15 s."""
    consumer = new_consumer(
        kafka.bootstrap, INFERENCES_TOPIC, FEEDBACK_TOPIC, security=PLAINTEXT, group_id="pinned"
    )
    started = time.monotonic()
    while not consumer.assignment() and time.monotonic() - started < 10:
        consumer.poll(timeout_ms=100)
    assignment = consumer.assignment()
    consumer.close()
    expected = {
        TopicPartition(t, p) for t in (INFERENCES_TOPIC, FEEDBACK_TOPIC) for p in range(kafka.partitions)
    }
    assert assignment == expected
