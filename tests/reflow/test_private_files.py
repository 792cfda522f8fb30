"""What only the user running reflow may read: the data dir, created 0700 by whichever process makes
it first, and the store in it, 0600 (an older store readable by others included)."""

from __future__ import annotations

from pathlib import Path

from feedback.bus.kafka import FEEDBACK_TOPIC, Record
from feedback.bus.outbox import Outbox
from reflow.registry import Registry
from reflow.settings import Settings
from reflow.store.database import migrate, open_db


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_store_and_the_data_dir_it_is_created_in_are_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    migrate(open_db(f"sqlite:///{data_dir / 'reflow.db'}"))  # its secrets table among others
    assert mode(data_dir) == 0o700
    files = {p.name: mode(p) for p in data_dir.iterdir()}
    assert files and set(files.values()) == {0o600}, files  # the store, and SQLite's journal beside it


def test_a_store_others_could_read_is_made_private(tmp_path: Path) -> None:
    store = tmp_path / "reflow.db"
    migrate(open_db(f"sqlite:///{store}"))
    store.chmod(0o644)  # as older releases left it
    open_db(f"sqlite:///{store}").dispose()
    assert mode(store) == 0o600


def test_the_embedded_registry_creates_the_data_dir_private(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    Registry.from_settings(Settings(data_dir=data_dir)).aliases("arith")  # MLflow makes its store
    assert mode(data_dir) == 0o700


def test_the_outbox_and_the_data_dir_it_is_created_in_are_private(tmp_path: Path) -> None:
    """`reflow feedback ingest` on a fresh data dir makes the outbox first: prompts wait there."""
    data_dir = tmp_path / "data"
    outbox = Outbox(data_dir / "outbox.db")
    outbox.append([Record(FEEDBACK_TOPIC, b"key", b"{}")])
    assert mode(data_dir) == 0o700
    files = {p.name: mode(p) for p in data_dir.iterdir()}
    outbox.close()
    assert "outbox.db" in files and set(files.values()) == {0o600}, files  # and SQLite's WAL beside it
