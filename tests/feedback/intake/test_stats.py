"""Offsets asked of a real broker while a partition is unknown to the client: asked again, then named."""

from __future__ import annotations

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition

from feedback.bus.kafka import FEEDBACK_TOPIC, new_consumer
from feedback.intake.stats import listed_offsets
from reflow.kafka_settings import PLAINTEXT
from tests.support.kafka import Broker


def test_a_partition_unknown_at_first_is_asked_for_again(kafka: Broker) -> None:
    """kafka-python raises KeyError for a partition it has no leader or offset for yet (a topic
    made a moment ago). Whether a real topic is still unknown on the first ask depends on the
    broker (Tansu creates a topic when its metadata is asked for), so the first ask also names a
    partition the broker never has: kafka-python's own KeyError, every time."""
    consumer = new_consumer(kafka.bootstrap, security=PLAINTEXT, group_id=None)
    asked = [TopicPartition(FEEDBACK_TOPIC, 0)]
    failures: list[KeyError] = []

    def beginning_offsets(partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The consumer's, with an unknown partition named on the first ask."""
        unknown = [] if failures else [TopicPartition(FEEDBACK_TOPIC, 99)]
        try:
            return consumer.beginning_offsets([*partitions, *unknown])
        except KeyError as error:
            failures.append(error)
            raise

    try:
        assert listed_offsets(beginning_offsets, asked, timeout_s=30) == dict.fromkeys(asked, 0)
        assert len(failures) == 1  # kafka-python failed once; asked again, it answered
    finally:
        consumer.close()


def test_a_partition_that_never_appears_is_named_after_the_timeout(kafka: Broker) -> None:
    consumer = new_consumer(kafka.bootstrap, security=PLAINTEXT, group_id=None)
    missing = TopicPartition(FEEDBACK_TOPIC, 99)
    try:
        with pytest.raises(KafkaTimeoutError, match=r"partition=99\).* in 0\.5 s"):
            listed_offsets(consumer.end_offsets, [TopicPartition(FEEDBACK_TOPIC, 0), missing], timeout_s=0.5)
    finally:
        consumer.close()
