"""Inference events: what the gateway publishes of every finished completion, and of every failed
request of an experiment (for its error-rate guardrail), off the request path, each within
REFLOW_MAX_EVENT_BYTES."""

from __future__ import annotations

import logging
import time

from pydantic import ValidationError

from feedback.bus.publisher import Publisher
from feedback.events import MAX_COUNT, ChatMessage, InferenceEvent, Latency, Routing, TokenUsage, storable
from gateway.relay import Generation
from reflow.registry import CHALLENGER
from reflow.store.tables import utcnow
from reflow.v1 import inference_pb2

logger = logging.getLogger(__name__)


class InferenceLog:
    """Hands inference events to the publisher; a completion never fails because of its event."""

    def __init__(self, publisher: Publisher, max_event_bytes: int):
        self.publisher = publisher
        self.max_event_bytes = max_event_bytes  # an event over it has its texts cut to fit

    def finished(
        self,
        generation: Generation,
        header: inference_pb2.GenerateResponse,
        last: inference_pb2.GenerateResponse,
        answer: str,
        reasoning: str,
    ) -> None:
        """The event of a finished generation: `header` says where it ran, `last` how it ended."""
        usage = last.usage
        self._publish(
            generation, header,
            finish_reason=inference_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_"),
            usage=TokenUsage(
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                reasoning_tokens=usage.reasoning_tokens,
            ),
            latency=Latency(first_token_ms=usage.time_to_first_token_ms, total_ms=usage.total_ms),
            placed=header.routing, answer=answer, reasoning=reasoning,
        )  # fmt: skip

    def failed(self, generation: Generation) -> None:
        """The event of a failed request of an experiment, on the version of its arm."""
        assignment = generation.assignment
        experiment = assignment.experiment
        assert experiment is not None
        version = (
            experiment.challenger_version if assignment.arm == CHALLENGER else experiment.champion_version
        )
        header = inference_pb2.GenerateResponse(
            request_id=generation.request_id, model=experiment.model, model_version=version,
            arm=assignment.arm,
        )  # fmt: skip
        elapsed_ms = (time.perf_counter() - generation.received) * 1000
        self._publish(
            generation, header, finish_reason="ERROR",
            usage=TokenUsage(prompt_tokens=0, completion_tokens=0, reasoning_tokens=0),
            latency=Latency(first_token_ms=elapsed_ms, total_ms=elapsed_ms),
        )  # fmt: skip

    def _publish(
        self,
        generation: Generation,
        header: inference_pb2.GenerateResponse,
        *,
        finish_reason: str,
        usage: TokenUsage,
        latency: Latency,
        placed: inference_pb2.Routing | None = None,
        answer: str = "",
        reasoning: str = "",
    ) -> None:
        """Publishes an inference event; one that cannot be made is logged, never raised."""
        request, experiment = generation.request, generation.assignment.experiment
        try:
            event = InferenceEvent(
                request_id=header.request_id, tenant=generation.tenant.name,
                user_id=storable(request.user_id), model=header.model, version=header.model_version,
                arm=header.arm, experiment=experiment.id if experiment is not None else None,
                prompt=storable(request.prompt), messages=_messages(request),
                reasoning=storable(reasoning), completion=storable(answer),
                finish_reason=finish_reason, usage=usage, latency=latency,
                routing=None if placed is None else _routing(request, placed), time=utcnow(),
            )  # fmt: skip
        except ValidationError:
            logger.exception("request_id=%s: no inference event could be made", header.request_id)
            return
        fitted = event.within(self.max_event_bytes)
        if fitted is not event:
            logger.warning(
                "request_id=%s: the inference event's texts were cut to fit REFLOW_MAX_EVENT_BYTES=%d",
                header.request_id, self.max_event_bytes,
            )  # fmt: skip
        self.publisher.enqueue(fitted.to_record())


def _messages(request: inference_pb2.GenerateRequest) -> list[ChatMessage] | None:
    """The conversation of a chat request as the event records it; None for a prompt."""
    messages = [ChatMessage(role=storable(m.role), content=storable(m.content)) for m in request.messages]
    return messages or None


def _routing(request: inference_pb2.GenerateRequest, routing: inference_pb2.Routing) -> Routing:
    """The event's record of how the generation was placed."""
    return Routing(
        variant=routing.variant, latency_budget_ms=min(request.latency_budget_ms, MAX_COUNT),
        predicted_first_token_ms=routing.predicted_time_to_first_token_ms,
        predicted_total_ms=routing.predicted_total_ms,
        # a uint32 past the store's INTEGER bounds nothing a model reaches: stored as its largest
        reasoning_budget=min(routing.reasoning_budget, MAX_COUNT),
    )  # fmt: skip
