"""Hands records over durably: to Kafka (acks=all) while it answers, to the outbox while it does not.

`publish` returns once every record is durable in one of the two, which is when the gateway may
acknowledge feedback. While the outbox holds anything, new records go behind it (so they keep
their order), and a background thread sends the outbox to Kafka, oldest first, as soon as Kafka
is back. A record Kafka refuses for good (too large, not authorized for its topic) is no outage:
it goes to the outbox's dead letters with the reason, and the records behind it go on.
`enqueue` is the fire-and-forget form for inference events: the same thread hands them over in
batches, off the request path; past `queue_max` of them in memory, they go to the outbox at once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kafka import KafkaProducer
from kafka.errors import (
    IllegalSaslStateError,
    IllegalStateError,
    KafkaConfigurationError,
    KafkaError,
    SaslAuthenticationFailedError,
    UnrecognizedBrokerVersion,
    UnsupportedVersionError,
)

from feedback.bus.kafka import Record, new_producer
from feedback.bus.outbox import Outbox
from reflow.kafka_settings import PublisherConfig

logger = logging.getLogger(__name__)
FLUSH_BATCH = 1000  # outbox records sent per round
RETRY_S = 1.0  # pause between rounds while Kafka is unreachable
RECORD_FRAMING_BYTES = 1024  # what a produce request holds beyond a record's value: key, batch header
# Errors Kafka does not retry that are about this client or its connection, not about a record:
# every record would meet them, so records wait for them to be fixed, as for an outage.
CLIENT_ERRORS = (
    IllegalStateError,
    KafkaConfigurationError,
    SaslAuthenticationFailedError,
    IllegalSaslStateError,
    UnsupportedVersionError,
    UnrecognizedBrokerVersion,
)


def refused_for_good(error: Exception) -> bool:
    """Whether sending a record again would fail again: Kafka refused the record itself (too large,
    an invalid record or topic, not authorized for its topic), not just for now (down, slow,
    electing a leader). kafka-python raises ValueError or TypeError for a record it cannot send."""
    if isinstance(error, KafkaError):
        return not error.retriable and not isinstance(error, CLIENT_ERRORS)
    return isinstance(error, ValueError | TypeError)


@dataclass
class Handover:
    """What Kafka made of a list of records, by index: those it failed to ack for now, and those it
    refused for good with why; the others it acked."""

    failed: list[int] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)


class Publisher:
    """Kafka first, the outbox as the fallback; thread-safe."""

    def __init__(self, bootstrap: str, outbox_path: Path, config: PublisherConfig):
        self.handover_timeout_s = config.handover_timeout_s
        self.queue_max = config.queue_max
        self.producer: KafkaProducer = new_producer(
            bootstrap,
            security=config.security,
            max_block_ms=int(config.handover_timeout_s * 1000),
            max_request_size=config.max_record_bytes + RECORD_FRAMING_BYTES,  # larger: refused for good
        )
        self.outbox = Outbox(outbox_path)
        self._lock = threading.Lock()  # orders "is the outbox in use?" against appends and draining
        self._behind = len(self.outbox) > 0  # records wait in the outbox: new ones queue behind them
        self._queue: queue.SimpleQueue[Record | None] = queue.SimpleQueue()
        self._held = 0  # enqueued records in memory: queued, or being handed over
        self._closed = threading.Event()
        self._close_by = float("inf")
        self._kafka_answered = True  # whether the last outbox round was acked
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Records in the outbox, waiting for Kafka."""
        return len(self.outbox)

    @property
    def dead_letters(self) -> int:
        """Records Kafka refused for good, kept in the outbox's dead letters."""
        return self.outbox.dead_letter_count()

    def publish(self, records: Sequence[Record]) -> None:
        """Returns once every record is acked by Kafka or stored in the outbox (or, refused by Kafka
        for good, in its dead letters)."""
        with self._lock:
            if self._behind:
                self.outbox.append(records)
                return
        handover = self._send(records)
        if handover.refused:
            self.outbox.bury([(records[i], reason) for i, reason in handover.refused])
        failed = [records[i] for i in handover.failed]
        if failed:
            with self._lock:
                self.outbox.append(failed)
                if not self._behind:
                    logger.warning(
                        "Kafka is not acknowledging; records go to the outbox %s", self.outbox.path
                    )
                self._behind = True

    def enqueue(self, record: Record) -> None:
        """Publishes `record` in the background; `close` waits for it. Past `queue_max` records
        held in memory, it goes to the outbox instead (one fsynced write, on the caller's thread)."""
        with self._lock:
            if self._held < self.queue_max:
                self._held += 1
                self._queue.put(record)
                return
            self.outbox.append([record])
            if not self._behind:
                logger.warning(
                    "%d records wait in memory for Kafka (REFLOW_EVENT_QUEUE_MAX); more go to the outbox %s",
                    self._held, self.outbox.path,
                )  # fmt: skip
            self._behind = True

    def _send(self, records: Sequence[Record]) -> Handover:
        """Sends `records` and waits for their acks until the handover timeout."""
        deadline = time.monotonic() + self.handover_timeout_s
        handover = Handover()
        futures = []
        for i, record in enumerate(records):
            try:
                futures.append((i, self.producer.send(record.topic, key=record.key, value=record.value)))
            except Exception as error:
                if not refused_for_good(error):  # no metadata within max_block_ms: the broker is down
                    logger.debug("send failed: %s", error)
                    handover.failed += range(i, len(records))
                    break
                handover.refused.append((i, _refusal(record, error)))
        with contextlib.suppress(KafkaError):
            self.producer.flush(timeout=max(deadline - time.monotonic(), 0.0))
        for i, future in futures:
            try:
                future.get(timeout=max(deadline - time.monotonic(), 0.0))
            except KafkaError as error:
                if not refused_for_good(error):
                    logger.debug("record not acked: %s", error)
                    handover.failed.append(i)
                else:
                    handover.refused.append((i, _refusal(records[i], error)))
        handover.failed.sort()
        return handover

    def _run(self) -> None:
        """Hands queued records over and drains the outbox; after `close`, until its deadline.

        Every RETRY_S it also looks at the outbox itself, so records another process left there
        (an ingest that ran while Kafka was down) are sent too. An unexpected error is logged and
        the loop goes on: this thread is the only one that empties the outbox.
        """
        next_look = time.monotonic()
        while True:
            closing = self._closed.is_set()
            if closing and self._queue.empty() and (not self._behind or time.monotonic() > self._close_by):
                return
            try:
                batch = _take(self._queue, FLUSH_BATCH, timeout_s=0.0 if closing else 0.5)
                if batch:
                    try:
                        self.publish(batch)
                    finally:
                        with self._lock:
                            self._held -= len(batch)
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + RETRY_S
                    with self._lock:
                        self._behind = self._behind or len(self.outbox) > 0
                if self._behind and not self._drain_once():
                    time.sleep(
                        min(RETRY_S, max(self._close_by - time.monotonic(), 0.0)) if closing else RETRY_S
                    )
            except Exception:  # e.g. the outbox's disk is full: keep trying rather than die
                logger.exception("the publisher failed a round; retrying in %.0fs", RETRY_S)
                time.sleep(RETRY_S)

    def _drain_once(self) -> bool:
        """Sends one batch of the outbox; False when Kafka did not take it. After a failure the
        next round sends just the oldest record, so a dead broker is probed with one record, not
        a thousand copies piling up in the producer's buffer."""
        rows = self.outbox.oldest(FLUSH_BATCH if self._kafka_answered else 1)
        handover = self._send([record for _, record in rows])
        if handover.refused:
            self.outbox.move_to_dead_letters([(rows[i][0], reason) for i, reason in handover.refused])
        self._kafka_answered = not handover.failed
        if not self._kafka_answered:
            return False
        refused = {i for i, _ in handover.refused}
        self.outbox.remove([row_id for i, (row_id, _) in enumerate(rows) if i not in refused])
        with self._lock:
            if len(self.outbox) == 0 and self._behind:
                self._behind = False
                logger.info("Kafka is back; the outbox is empty again")
        return True

    def close(self, timeout_s: float = 10.0) -> int:
        """Hands over what was enqueued, gives the outbox `timeout_s` to drain, then stops; returns
        how many records stay in the outbox (for whichever process opens it next)."""
        self._close_by = time.monotonic() + timeout_s
        self._closed.set()
        self._queue.put(None)  # wakes the thread
        self._thread.join(timeout_s + 2 * self.handover_timeout_s)
        with contextlib.suppress(KafkaError):  # records it still holds are in the outbox too
            self.producer.close(timeout=1.0)
        left = len(self.outbox)
        if left:
            logger.warning("%d records stay in the outbox %s for the next start", left, self.outbox.path)
        if not self._thread.is_alive():  # else it still uses the outbox; the process exit closes it
            self.outbox.close()
        return left


def _refusal(record: Record, error: Exception) -> str:
    """Why Kafka refused `record` for good, logged as it goes to the dead letters."""
    reason = f"Kafka refused the record ({len(record.value)} bytes) for good: {error}"
    logger.error("record on %s key=%r to the dead letters: %s", record.topic, record.key, reason)
    return reason


def _take(source: queue.SimpleQueue[Record | None], limit: int, timeout_s: float) -> list[Record]:
    """Up to `limit` records: waits `timeout_s` for the first, then takes what is already there."""
    try:
        first = source.get(timeout=timeout_s)
    except queue.Empty:
        return []
    batch = [first] if first is not None else []
    while len(batch) < limit:
        try:
            item = source.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            batch.append(item)
    return batch
