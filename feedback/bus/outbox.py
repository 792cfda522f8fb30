"""The durable outbox: records that Kafka could not take yet, in a SQLite file in the data dir, and
beside them the dead letters: records Kafka refused for good (too large, not authorized).

Appends are fsynced before they return (synchronous=FULL), so a record in the outbox survives a
crash of the process and of the machine. Records leave in the order they came, once Kafka acked
them, or to the dead letters with the reason Kafka gave. Several processes may share one outbox
file: each may then send a record, and the consumer stores it once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from feedback.bus.kafka import Record
from reflow.private_files import private_file

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS outbox "
    "(id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, key BLOB, value BLOB NOT NULL)",
    "CREATE TABLE IF NOT EXISTS dead_letters (id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, "
    "key BLOB, value BLOB NOT NULL, reason TEXT NOT NULL, time TEXT NOT NULL)",
)


class DeadLetter(NamedTuple):
    """A record Kafka refused for good, why, and when (ISO 8601, UTC)."""

    record: Record
    reason: str
    time: str


class Outbox:
    """An append-only queue of Kafka records on disk, and its dead letters; thread-safe."""

    def __init__(self, path: Path):
        private_file(path)  # its records hold prompts and completions: for reflow's user only
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        for statement in SCHEMA:
            self._db.execute(statement)

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

    def bury(self, refused: Sequence[tuple[Record, str]]) -> None:
        """Keeps records Kafka refused for good in the dead letters, each with its reason."""
        now = _now()
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT INTO dead_letters (topic, key, value, reason, time) VALUES (?, ?, ?, ?, ?)",
                [(*record, reason, now) for record, reason in refused],
            )

    def move_to_dead_letters(self, refused: Sequence[tuple[int, str]]) -> None:
        """Moves outbox records (by id) to the dead letters with their reasons; a record another
        process moved or sent already is left alone."""
        now = _now()
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for row_id, reason in refused:
                self._db.execute(
                    "INSERT INTO dead_letters (topic, key, value, reason, time) "
                    "SELECT topic, key, value, ?, ? FROM outbox WHERE id = ?",
                    (reason, now, row_id),
                )
                self._db.execute("DELETE FROM outbox WHERE id = ?", (row_id,))

    def dead_letters(self) -> list[DeadLetter]:
        """Every dead letter, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT topic, key, value, reason, time FROM dead_letters ORDER BY id"
            ).fetchall()
        return [DeadLetter(Record(row[0], row[1], row[2]), row[3], row[4]) for row in rows]

    def dead_letter_count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM dead_letters").fetchone()[0])

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM outbox").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
