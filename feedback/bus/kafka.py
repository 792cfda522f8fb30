"""Kafka clients as reflow uses them: the topic names, client settings that work against both
Apache Kafka and the embedded Tansu broker, and topic creation. Every client is made here, with the
connection's security (TLS, SASL) applied."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, NamedTuple

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from reflow.endpoints import read_endpoints
from reflow.errors import Unavailable
from reflow.kafka_settings import KafkaSecurity


class Record(NamedTuple):
    """One Kafka record: its topic, key (orders records of one request) and JSON value."""

    topic: str
    key: bytes
    value: bytes


INFERENCES_TOPIC = "reflow.inferences"
FEEDBACK_TOPIC = "reflow.feedback"
DLQ_TOPIC = "reflow.feedback.dlq"
TOPICS = (INFERENCES_TOPIC, FEEDBACK_TOPIC, DLQ_TOPIC)
STORE_GROUP = "reflow-store"  # the consumer group that writes events to the store

# Pinned rather than probed. kafka-python 3.x against Tansu gets no partitions in a consumer group
# unless the API version is pinned to (2, 8); every Kafka broker since 2.8 speaks it too.
API_VERSION = (2, 8)
# A short session makes a group form in ~3 s on Tansu (~15 s with the 45 s default) and hands the
# partitions of a consumer that was killed to its successor within 6 s.
SESSION_TIMEOUT_MS = 6_000
HEARTBEAT_INTERVAL_MS = 1_000
RECONNECT_BACKOFF_MAX_MS = 1_000  # find a restarted broker within a second, not 30


def resolve_bootstrap(configured: str, data_dir: Path) -> str:
    """The configured bootstrap servers (REFLOW_KAFKA_BOOTSTRAP), else the embedded broker of a
    running `reflow up` in `data_dir` (its endpoints.json)."""
    if configured:
        return configured
    bootstrap = (read_endpoints(data_dir) or {}).get("kafka")
    if bootstrap:
        return str(bootstrap)
    raise Unavailable(
        "no Kafka broker: set REFLOW_KAFKA_BOOTSTRAP=host:port, or start `reflow up` "
        f"with this data dir ({data_dir}) to use its embedded broker"
    )


def new_producer(bootstrap: str, *, security: KafkaSecurity, **overrides: Any) -> KafkaProducer:
    """A producer that reports a record sent only once every in-sync replica has it (acks=all).

    Idempotence is off: its producer ids do not survive a restart of the memory-only embedded
    broker, and the consumer already drops redelivered records by their keys.
    """
    config: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        **security.client_options(),
        "api_version": API_VERSION,
        "acks": "all",
        "enable_idempotence": False,
        "linger_ms": 2,
        "batch_size": 256 * 1024,
        "max_block_ms": 5_000,
        "request_timeout_ms": 5_000,
        "delivery_timeout_ms": 30_000,
        "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        **overrides,
    }
    return KafkaProducer(**config)


def new_consumer(
    bootstrap: str, *topics: str, security: KafkaSecurity, group_id: str | None, **overrides: Any
) -> KafkaConsumer:
    """A consumer that commits offsets only when told to, starting from the earliest record."""
    config: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        **security.client_options(),
        "api_version": API_VERSION,
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "session_timeout_ms": SESSION_TIMEOUT_MS,
        "heartbeat_interval_ms": HEARTBEAT_INTERVAL_MS,
        "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        **overrides,
    }
    return KafkaConsumer(*topics, **config)


def new_admin(bootstrap: str, *, security: KafkaSecurity) -> KafkaAdminClient:
    """An admin client for topics and consumer-group offsets; it gives up on brokers that do not
    answer (or speak another protocol) within 5 s, as its callers are commands that say so."""
    return KafkaAdminClient(
        bootstrap_servers=bootstrap,
        **security.client_options(),
        api_version=API_VERSION,
        request_timeout_ms=5_000,
        bootstrap_timeout_ms=5_000,
    )


def ensure_topics(bootstrap: str, partitions: int, *, security: KafkaSecurity) -> None:
    """Creates reflow's topics with `partitions` partitions each; existing ones are left as they are."""
    admin = new_admin(bootstrap, security=security)
    try:
        for topic in TOPICS:
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        admin.close()
