"""`reflow feedback ingest` as an operator runs it, against a real broker, consumer and store."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from feedback.intake.stats import kafka_stats, store_counts
from gateway.tenants import create_tenant
from reflow.kafka_settings import PLAINTEXT
from reflow.request_ids import RequestIds
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from tests.support.cli import reflow
from tests.support.kafka import Broker, consuming
from tests.support.waiting import wait_for


@pytest.fixture
def store(settings: Settings, kafka: Broker) -> Iterator[Engine]:
    """The data dir's store with tenants acme and globex, and a consumer writing into it."""
    db = open_db(settings.resolved_database_url)
    migrate(db)
    create_tenant(db, "acme")
    create_tenant(db, "globex")
    with consuming(kafka.bootstrap, db):
        yield db


def ingest(settings: Settings, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"REFLOW_DATA_DIR": str(settings.data_dir), "REFLOW_KAFKA_BOOTSTRAP": settings.kafka_bootstrap}
    return reflow("feedback", "ingest", *args, env=env, stdin=stdin, timeout_s=120)


def settled(db: Engine, kafka: Broker, feedback: int) -> None:
    """Waits until the consumer has committed everything and the store holds `feedback` rows."""
    wait_for(
        lambda: sum(kafka_stats(kafka.bootstrap, security=PLAINTEXT)["consumer_lag"].values()) == 0,
        what="no lag",
    )
    wait_for(lambda: store_counts(db)["feedback"] == feedback, what=f"{feedback} rows")


def test_ingest_reports_bad_lines_skips_them_and_stores_a_rerun_once(
    settings: Settings, kafka: Broker, store: Engine, tmp_path: Path
) -> None:
    ids = RequestIds.from_store(store)
    ours, theirs = ids.new("acme"), ids.new("globex")
    lines = [
        json.dumps({"feedback_id": "f1", "request_id": ours, "rating": 1}),
        json.dumps({"request_id": ours, "rating": -1, "correction": "42", "labels": {"src": "csv"}}),
        "",
        "{not json",
        json.dumps({"request_id": ours, "rating": 3}),
        json.dumps({"request_id": theirs, "rating": 1}),
        json.dumps([1, 2]),
        json.dumps({"request_id": ours, "rating": 1, "score": 5}),
    ]
    path = tmp_path / "feedback.jsonl"
    path.write_text("\n".join(lines) + "\n")

    result = ingest(settings, str(path), "--tenant", "acme")
    assert result.returncode == 1, result.stderr
    reported = [line for line in result.stderr.splitlines() if line.startswith("line ")]
    assert [line.split(":")[0] for line in reported] == ["line 4", "line 5", "line 6", "line 7", "line 8"]
    assert "not valid JSON" in reported[0] and "rating" in reported[1]
    assert "not served to this tenant" in reported[2] and "expected a JSON object" in reported[3]
    assert "unknown field(s) score" in reported[4]
    assert "accepted 2, rejected 5" in result.stderr
    settled(store, kafka, feedback=2)

    assert ingest(settings, str(path), "--tenant", "acme").returncode == 1  # the same file again
    settled(store, kafka, feedback=2)

    result = ingest(settings, "-", stdin=json.dumps({"request_id": theirs, "rating": -1}) + "\n")
    assert result.returncode == 2 and "no active tenant named 'default'" in result.stderr
    result = ingest(
        settings, "-", "--tenant", "globex", stdin=json.dumps({"request_id": theirs, "rating": -1})
    )
    assert result.returncode == 0, result.stderr
    assert "accepted 1, rejected 0" in result.stderr
    settled(store, kafka, feedback=3)
