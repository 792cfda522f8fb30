"""The publisher: Kafka while it acks, the outbox while it does not, in order, across restarts."""

from __future__ import annotations

import time
from pathlib import Path

from feedback.bus.kafka import FEEDBACK_TOPIC, Record
from feedback.bus.publisher import Publisher
from tests.support.kafka import Broker
from tests.support.waiting import wait_for


def records(*values: str) -> list[Record]:
    return [Record(FEEDBACK_TOPIC, b"same-key", value.encode()) for value in values]  # one partition


def test_records_reach_kafka_directly_while_it_acks(kafka: Broker, tmp_path: Path) -> None:
    publisher = Publisher(kafka.bootstrap, tmp_path / "outbox.db", handover_timeout_s=5.0)
    publisher.publish(records("a", "b"))
    publisher.enqueue(records("c")[0])
    assert publisher.close() == 0
    assert [r.value for r in kafka.read(FEEDBACK_TOPIC, 3)] == [b"a", b"b", b"c"]


HANDOVER_S = 2.0


def test_the_outbox_keeps_records_while_the_broker_is_down_and_sends_them_in_order(tmp_path: Path) -> None:
    broker = Broker()  # not started: nothing listens on its port
    publisher = Publisher(broker.bootstrap, tmp_path / "outbox.db", handover_timeout_s=HANDOVER_S)
    started = time.monotonic()
    publisher.publish(records("1", "2"))  # waits HANDOVER_S for Kafka, then keeps them
    publisher.publish(records("3"))  # behind the first two, without waiting for Kafka again
    assert time.monotonic() - started < 2 * HANDOVER_S  # a second wait would take as long again
    assert publisher.pending == 3
    broker.start()
    try:
        wait_for(lambda: publisher.pending == 0, 30, what="the outbox to drain")
        publisher.publish(records("4"))  # straight to Kafka again
        assert publisher.close() == 0
        assert [r.value for r in broker.read(FEEDBACK_TOPIC, 4)] == [b"1", b"2", b"3", b"4"]
    finally:
        broker.stop()


def test_the_outbox_outlives_the_process_that_wrote_it(tmp_path: Path) -> None:
    broker = Broker()
    first = Publisher(broker.bootstrap, tmp_path / "outbox.db", handover_timeout_s=0.5)
    first.publish(records("kept"))
    assert first.close(timeout_s=0.5) == 1  # left for the next process
    broker.start()
    try:
        second = Publisher(broker.bootstrap, tmp_path / "outbox.db", handover_timeout_s=5.0)
        assert second.close() == 0  # sent on close at the latest
        assert [r.value for r in broker.read(FEEDBACK_TOPIC, 1)] == [b"kept"]
    finally:
        broker.stop()
