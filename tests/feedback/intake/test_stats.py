"""Offsets asked of a real broker while a partition is unknown to the client: asked again, then named."""

from __future__ import annotations

import contextlib

import pytest
from kafka.admin import NewTopic
from kafka.errors import KafkaTimeoutError, TopicAlreadyExistsError
from kafka.structs import TopicPartition

from feedback.bus.kafka import FEEDBACK_TOPIC, new_admin, new_consumer
from feedback.intake.stats import listed_offsets
from reflow.kafka_settings import PLAINTEXT
from tests.support.kafka import Broker


def test_a_topic_created_while_its_offsets_are_asked_for_is_answered(kafka: Broker) -> None:
    consumer = new_consumer(kafka.bootstrap, security=PLAINTEXT, group_id=None)
    admin = new_admin(kafka.bootstrap, security=PLAINTEXT)
    asked = [TopicPartition(FEEDBACK_TOPIC, 0), TopicPartition("created-later", 0)]
    failures: list[KeyError] = []

    def beginning_offsets(partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The consumer's; the topic is created right after the first time kafka-python fails on it."""
        try:
            return consumer.beginning_offsets(partitions)
        except KeyError as error:
            if not failures:
                with contextlib.suppress(TopicAlreadyExistsError):  # unless the broker made it
                    admin.create_topics([NewTopic("created-later", 1, 1)])
            failures.append(error)
            raise

    try:
        assert listed_offsets(beginning_offsets, asked, timeout_s=30) == dict.fromkeys(asked, 0)
        assert failures  # kafka-python alone failed on the unknown topic first: asked again
    finally:
        consumer.close()
        admin.close()


def test_a_partition_that_never_appears_is_named_after_the_timeout(kafka: Broker) -> None:
    consumer = new_consumer(kafka.bootstrap, security=PLAINTEXT, group_id=None)
    missing = TopicPartition(FEEDBACK_TOPIC, 99)
    try:
        with pytest.raises(KafkaTimeoutError, match=r"partition=99\).* in 0\.5 s"):
            listed_offsets(consumer.end_offsets, [TopicPartition(FEEDBACK_TOPIC, 0), missing], timeout_s=0.5)
    finally:
        consumer.close()
