"""The durable outbox: records that Kafka could not take yet, in a SQLite file in the data dir.

Appends are fsynced before they return (synchronous=FULL), so a record in the outbox survives a
crash of the process and of the machine. Records leave in the order they came, once Kafka acked
them. Several processes may share one outbox file: each may then send a record, and the consumer
stores it once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from feedback.bus.kafka import Record


class Outbox:
    """An append-only queue of Kafka records on disk; thread-safe."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS outbox "
            "(id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, key BLOB, value BLOB NOT NULL)"
        )

    def append(self, records: Sequence[Record]) -> None:
        """Stores `records` durably, in order, in one transaction."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("INSERT INTO outbox (topic, key, value) VALUES (?, ?, ?)", records)

    def oldest(self, limit: int) -> list[tuple[int, Record]]:
        """Up to `limit` of the oldest records with their ids."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, topic, key, value FROM outbox ORDER BY id LIMIT ?", (limit,)
            ).fetchall()
        return [(row[0], Record(row[1], row[2], row[3])) for row in rows]

    def remove(self, ids: Sequence[int]) -> None:
        """Forgets records that Kafka has acked."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM outbox").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
