"""Hands records over durably: to Kafka (acks=all) while it answers, to the outbox while it does not.

`publish` returns once every record is durable in one of the two, which is when the gateway may
acknowledge feedback. While the outbox holds anything, new records go behind it (so they keep
their order), and a background thread sends the outbox to Kafka, oldest first, as soon as Kafka
is back. `enqueue` is the fire-and-forget form for inference events: the same thread hands them
over in batches, off the request path.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kafka import KafkaProducer
from kafka.errors import KafkaError
from kafka.producer.future import FutureRecordMetadata

from feedback.bus.kafka import Record, new_producer
from feedback.bus.outbox import Outbox

logger = logging.getLogger(__name__)
FLUSH_BATCH = 1000  # outbox records sent per round
RETRY_S = 1.0  # pause between rounds while Kafka is unreachable


class Publisher:
    """Kafka first, the outbox as the fallback; thread-safe."""

    def __init__(self, bootstrap: str, outbox_path: Path, handover_timeout_s: float):
        self.handover_timeout_s = handover_timeout_s
        self.producer: KafkaProducer = new_producer(bootstrap, max_block_ms=int(handover_timeout_s * 1000))
        self.outbox = Outbox(outbox_path)
        self._lock = threading.Lock()  # orders "is the outbox in use?" against appends and draining
        self._behind = len(self.outbox) > 0  # records wait in the outbox: new ones queue behind them
        self._queue: queue.SimpleQueue[Record | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._close_by = float("inf")
        self._kafka_answered = True  # whether the last outbox round was acked
        self._thread = threading.Thread(target=self._run, name="publisher", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Records in the outbox, waiting for Kafka."""
        return len(self.outbox)

    def publish(self, records: Sequence[Record]) -> None:
        """Returns once every record is acked by Kafka or stored in the outbox."""
        with self._lock:
            if self._behind:
                self.outbox.append(records)
                return
        failed = self._send(records)
        if failed:
            with self._lock:
                self.outbox.append(failed)
                if not self._behind:
                    logger.warning(
                        "Kafka is not acknowledging; records go to the outbox %s", self.outbox.path
                    )
                self._behind = True

    def enqueue(self, record: Record) -> None:
        """Publishes `record` in the background; `close` waits for it."""
        self._queue.put(record)

    def _send(self, records: Sequence[Record]) -> list[Record]:
        """Sends `records` and waits for their acks; returns the ones Kafka did not ack in time."""
        deadline = time.monotonic() + self.handover_timeout_s
        futures = []
        unsent: list[Record] = []
        for i, record in enumerate(records):
            try:
                futures.append(self.producer.send(record.topic, key=record.key, value=record.value))
            except KafkaError as error:  # no metadata within max_block_ms: the broker is down
                logger.debug("send failed: %s", error)
                unsent = list(records[i:])
                break
        with contextlib.suppress(KafkaError):
            self.producer.flush(timeout=max(deadline - time.monotonic(), 0.0))
        failed = [
            record for record, future in zip(records, futures, strict=False) if not _acked(future, deadline)
        ]
        return failed + unsent

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
                    self.publish(batch)
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
        self._kafka_answered = not (rows and self._send([record for _, record in rows]))
        if not self._kafka_answered:
            return False
        self.outbox.remove([row_id for row_id, _ in rows])
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


def _acked(future: FutureRecordMetadata, deadline: float) -> bool:
    try:
        future.get(timeout=max(deadline - time.monotonic(), 0.0))
        return True
    except KafkaError as error:
        logger.debug("record not acked: %s", error)
        return False


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
