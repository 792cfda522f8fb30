"""The publisher: Kafka while it acks, the outbox while it does not, in order, across restarts; a
record Kafka refuses for good to the dead letters, never in front of the others; inference events
in memory only up to a bound."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from feedback.bus.kafka import FEEDBACK_TOPIC, INFERENCES_TOPIC, Record
from feedback.bus.outbox import Outbox
from feedback.bus.publisher import Publisher
from reflow.kafka_settings import PLAINTEXT, PublisherConfig
from tests.support.cli import reflow
from tests.support.kafka import Broker
from tests.support.waiting import wait_for

MAX_RECORD_BYTES = 900_000  # REFLOW_MAX_EVENT_BYTES's default


def records(*values: str) -> list[Record]:
    return [Record(FEEDBACK_TOPIC, b"same-key", value.encode()) for value in values]  # one partition


def publisher(
    bootstrap: str, outbox: Path, handover_timeout_s: float = 5.0, queue_max: int = 10_000
) -> Publisher:
    config = PublisherConfig(PLAINTEXT, handover_timeout_s, MAX_RECORD_BYTES, queue_max)
    return Publisher(bootstrap, outbox, config)


def test_records_reach_kafka_directly_while_it_acks(kafka: Broker, tmp_path: Path) -> None:
    sending = publisher(kafka.bootstrap, tmp_path / "outbox.db")
    sending.publish(records("a", "b"))
    sending.enqueue(records("c")[0])
    assert sending.close() == 0
    assert [r.value for r in kafka.read(FEEDBACK_TOPIC, 3)] == [b"a", b"b", b"c"]


HANDOVER_S = 2.0


def test_the_outbox_keeps_records_while_the_broker_is_down_and_sends_them_in_order(tmp_path: Path) -> None:
    broker = Broker()  # not started: nothing listens on its port
    sending = publisher(broker.bootstrap, tmp_path / "outbox.db", handover_timeout_s=HANDOVER_S)
    started = time.monotonic()
    sending.publish(records("1", "2"))  # waits HANDOVER_S for Kafka, then keeps them
    sending.publish(records("3"))  # behind the first two, without waiting for Kafka again
    assert time.monotonic() - started < 2 * HANDOVER_S  # a second wait would take as long again
    assert sending.pending == 3
    broker.start()
    try:
        wait_for(lambda: sending.pending == 0, 30, what="the outbox to drain")
        sending.publish(records("4"))  # straight to Kafka again
        assert sending.close() == 0
        assert [r.value for r in broker.read(FEEDBACK_TOPIC, 4)] == [b"1", b"2", b"3", b"4"]
    finally:
        broker.stop()


def test_the_outbox_outlives_the_process_that_wrote_it(tmp_path: Path) -> None:
    broker = Broker()
    first = publisher(broker.bootstrap, tmp_path / "outbox.db", handover_timeout_s=0.5)
    first.publish(records("kept"))
    assert first.close(timeout_s=0.5) == 1  # left for the next process
    broker.start()
    try:
        second = publisher(broker.bootstrap, tmp_path / "outbox.db")
        assert second.close() == 0  # sent on close at the latest
        assert [r.value for r in broker.read(FEEDBACK_TOPIC, 1)] == [b"kept"]
    finally:
        broker.stop()


OVERSIZED = Record(FEEDBACK_TOPIC, b"same-key", b"x" * 2_000_000)  # over MAX_RECORD_BYTES


def assert_only_the_oversized_record_is_dead(outbox: Outbox) -> None:
    [dead] = outbox.dead_letters()
    assert dead.record == OVERSIZED
    assert "2000000 bytes" in dead.reason and "MessageSizeTooLargeError" in dead.reason


def test_a_record_kafka_refuses_for_good_goes_to_the_dead_letters_and_the_others_on(
    kafka: Broker, tmp_path: Path
) -> None:
    """Straight to Kafka: the oversized record first, five ratings behind it on its partition."""
    outbox = tmp_path / "data" / "outbox.db"  # where `reflow feedback dead-letters` looks
    sending = publisher(kafka.bootstrap, outbox)
    sending.publish([OVERSIZED, *records("1", "2", "3", "4", "5")])
    assert (sending.pending, sending.dead_letters) == (0, 1)
    assert_only_the_oversized_record_is_dead(sending.outbox)
    assert sending.close() == 0
    assert [r.value for r in kafka.read(FEEDBACK_TOPIC, 5)] == [b"1", b"2", b"3", b"4", b"5"]

    shown = reflow("feedback", "dead-letters", "--json", env={"REFLOW_DATA_DIR": str(outbox.parent)})
    assert shown.returncode == 0, shown.stderr
    [letter] = json.loads(shown.stdout)
    assert (letter["topic"], letter["key"], letter["bytes"]) == (FEEDBACK_TOPIC, "same-key", 2_000_000)
    assert "MessageSizeTooLargeError" in letter["reason"]


def test_a_record_kafka_refuses_for_good_does_not_jam_the_outbox(tmp_path: Path) -> None:
    """The same records kept in the outbox while the broker was down, the oversized one at its
    head: once the broker is back the five ratings are delivered and the outbox empties."""
    broker = Broker()  # not started
    sending = publisher(broker.bootstrap, tmp_path / "outbox.db", handover_timeout_s=0.5)
    sending.publish([OVERSIZED, *records("1", "2", "3", "4", "5")])
    assert sending.pending == 6
    broker.start()
    try:
        wait_for(lambda: sending.pending == 0, 30, what="the outbox to drain")
        assert sending.dead_letters == 1
        assert_only_the_oversized_record_is_dead(sending.outbox)
        assert sending.close() == 0
        assert [r.value for r in broker.read(FEEDBACK_TOPIC, 5)] == [b"1", b"2", b"3", b"4", b"5"]
    finally:
        broker.stop()


# Enqueues 20 events while Kafka is unreachable (its handover hangs for a minute), says so, and
# waits to be killed.
ENQUEUER = """
import sys, time
from pathlib import Path
from feedback.bus.kafka import INFERENCES_TOPIC, Record
from feedback.bus.publisher import Publisher
from reflow.kafka_settings import PLAINTEXT, PublisherConfig
sending = Publisher(sys.argv[1], Path(sys.argv[2]), PublisherConfig(PLAINTEXT, 60.0, 900_000, queue_max=5))
for i in range(20):
    sending.enqueue(Record(INFERENCES_TOPIC, b"same-key", str(i).encode()))
print("enqueued", flush=True)
time.sleep(600)
"""


def test_events_past_the_queue_bound_go_to_the_outbox_and_outlive_a_crash(tmp_path: Path) -> None:
    broker = Broker()  # not started: the first handover waits for it
    outbox = tmp_path / "outbox.db"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(ENQUEUER), broker.bootstrap, str(outbox)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "enqueued"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    left = Outbox(outbox)
    on_disk = [record.value for _, record in left.oldest(100)]
    left.close()
    # at most 5 were in memory when it died: the other 15 or more were on disk
    assert len(on_disk) >= 15 and len(set(on_disk)) == len(on_disk)
    assert set(on_disk) <= {str(i).encode() for i in range(20)}
    broker.start()
    try:
        restarted = publisher(broker.bootstrap, outbox)
        assert restarted.close() == 0
        assert [r.value for r in broker.read(INFERENCES_TOPIC, len(on_disk))] == on_disk
    finally:
        broker.stop()
