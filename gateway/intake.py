"""Feedback intake: items of a SubmitFeedback stream validated one by one and handed over durably
(to Kafka, or the outbox while it is down) in chunks, while the next ones are read."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from feedback.bus.kafka import Record
from feedback.bus.publisher import Publisher
from feedback.events import InvalidFeedback, feedback_event, require_served
from gateway.metrics import GatewayMetrics
from reflow.errors import InvalidArgument, PermissionDenied, RequestTooLarge, Unavailable
from reflow.request_ids import RequestIds
from reflow.store.tables import utcnow

logger = logging.getLogger(__name__)
FEEDBACK_CHUNK = 500  # items handed over to Kafka together
CHUNKS_IN_FLIGHT = 4  # chunks of one stream being handed over while more are read
MAX_LISTED_ERRORS = 1000  # rejected items listed one by one; the rest are counted

# The fields of one item as a face decoded them; an item its face could not decode (a line of
# NDJSON that is not a JSON object) arrives as the InvalidFeedback saying why, rejected in its place.
Item = dict[str, object] | InvalidFeedback


@dataclass(frozen=True)
class Rejection:
    """Why one item was not accepted: its index in the stream, its id, the reason and status name."""

    index: int
    feedback_id: str
    reason: str
    code: str


@dataclass
class IntakeResult:
    """What became of a stream of items: how many were accepted and rejected, and the rejections."""

    accepted: int = 0
    rejected: int = 0
    errors: list[Rejection] = field(default_factory=list)  # at most MAX_LISTED_ERRORS


class FeedbackIntake:
    """Takes a tenant's feedback items, at most `max_items` a request, and hands the valid ones over."""

    def __init__(
        self, request_ids: RequestIds, publisher: Publisher, metrics: GatewayMetrics, max_items: int
    ):
        self.request_ids = request_ids
        self.publisher = publisher
        self.metrics = metrics
        self.max_items = max_items

    async def submit(self, tenant: str, items: AsyncIterator[Item]) -> IntakeResult:
        """Validates each item (the fields of a Feedback message), hands the valid ones over in
        chunks while the next are read (at most CHUNKS_IN_FLIGHT at once), and returns once every
        chunk is durable. When every item is rejected it fails as a unary call would, with the
        status of the first. An item past `max_items` (valid or not) ends the reading: the items
        before it are handed over all the same, then the request fails with RequestTooLarge."""
        result = IntakeResult()
        first_error: InvalidFeedback | None = None
        chunk: list[Record] = []
        handovers: set[asyncio.Task[int]] = set()
        index = -1
        over_bound = False
        async for fields in items:
            index += 1
            if index == self.max_items:  # read no further; what came before is taken all the same
                over_bound = True
                break
            try:
                if isinstance(fields, InvalidFeedback):
                    raise fields
                event = require_served(feedback_event(tenant, fields, utcnow()), self.request_ids.served_to)
            except InvalidFeedback as error:
                first_error = first_error or error
                result.rejected += 1
                if len(result.errors) < MAX_LISTED_ERRORS:
                    feedback_id = "" if isinstance(fields, InvalidFeedback) else fields.get("feedback_id", "")
                    result.errors.append(Rejection(index, str(feedback_id), str(error), error.code))
                continue
            chunk.append(event.to_record())
            if len(chunk) >= FEEDBACK_CHUNK:
                handovers.add(asyncio.create_task(self._hand_over(chunk)))
                chunk = []
                if len(handovers) >= CHUNKS_IN_FLIGHT:
                    done, handovers = await asyncio.wait(handovers, return_when=asyncio.FIRST_COMPLETED)
                    if any(task.exception() for task in done):
                        await asyncio.gather(*handovers, return_exceptions=True)
                    result.accepted += sum(task.result() for task in done)
        if chunk:
            handovers.add(asyncio.create_task(self._hand_over(chunk)))
        outcomes = await asyncio.gather(*handovers, return_exceptions=True)  # every task ends first
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            result.accepted += outcome
        label = self.metrics.tenant(tenant)
        self.metrics.feedback.labels("accepted", label).inc(result.accepted)
        self.metrics.feedback.labels("rejected", label).inc(result.rejected)
        if over_bound:
            raise RequestTooLarge(
                f"a feedback request carries at most {self.max_items} items; the first {self.max_items} "
                f"were taken ({result.accepted} accepted, {result.rejected} rejected): send the rest in "
                "another request (items with the same feedback_id are stored once)"
            )
        if first_error is not None and result.accepted == 0:  # nothing taken: fail like a unary call would
            error_type = PermissionDenied if first_error.code == "PERMISSION_DENIED" else InvalidArgument
            more = f" ({result.rejected - 1} more item(s) rejected too)" if result.rejected > 1 else ""
            raise error_type(f"item {result.errors[0].index}: {first_error}{more}")
        return result

    async def _hand_over(self, chunk: list[Record]) -> int:
        """Publishes `chunk` durably (Kafka or the outbox); returns how many records that was."""
        try:
            await asyncio.to_thread(self.publisher.publish, chunk)
        except Exception as error:  # neither Kafka nor the outbox took it (a full disk?)
            logger.exception("feedback handover failed")
            raise Unavailable(
                f"feedback could not be stored ({type(error).__name__}); retry the stream: "
                "items with the same feedback_id are stored once"
            ) from error
        return len(chunk)
