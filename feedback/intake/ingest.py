"""`reflow feedback ingest`: feedback from a JSONL file, validated line by line, published to Kafka.

Each line is one JSON object with the fields of the Feedback message (request_id and rating are
required). A bad line is reported with its number and skipped; the rest goes on. Items without a
feedback_id get one derived from their content, so ingesting the same file twice stores it once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from feedback.bus.publisher import Publisher
from feedback.events import FeedbackEvent, InvalidFeedback, feedback_event, require_served
from reflow.request_ids import RequestIds
from reflow.store.tables import utcnow

CHUNK = 1000  # items handed over to Kafka together


@dataclass
class IngestReport:
    """What happened to each line: counts, and (line number, reason) of every rejected one."""

    accepted: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)


def parse_line(line: str, tenant: str, request_ids: RequestIds, time: datetime) -> FeedbackEvent:
    """The feedback on one line; InvalidFeedback saying what is wrong with it."""
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as error:
        raise InvalidFeedback(f"not valid JSON ({error})") from None
    if not isinstance(fields, dict):
        raise InvalidFeedback(f"expected a JSON object, got {type(fields).__name__}")
    return require_served(feedback_event(tenant, fields, time), request_ids.served_to)


def ingest(
    lines: Iterable[str],
    tenant: str,
    request_ids: RequestIds,
    publisher: Publisher,
    on_progress: Callable[[int], None] = lambda _bytes: None,
) -> IngestReport:
    """Publishes every valid line as `tenant`'s feedback; blank lines are skipped."""
    report = IngestReport()
    chunk = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                chunk.append(parse_line(line, tenant, request_ids, utcnow()).to_record())
            except InvalidFeedback as error:
                report.rejected.append((number, str(error)))
        if len(chunk) >= CHUNK:
            publisher.publish(chunk)
            report.accepted += len(chunk)
            chunk = []
        on_progress(len(line.encode()))
    if chunk:
        publisher.publish(chunk)
        report.accepted += len(chunk)
    return report
