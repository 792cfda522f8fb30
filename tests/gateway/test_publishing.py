"""Inference events as the gateway publishes them: one over REFLOW_MAX_EVENT_BYTES reaches Kafka
cut to fit, not refused; a record Kafka refuses all the same is counted."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from feedback.bus.kafka import INFERENCES_TOPIC, Record
from feedback.bus.outbox import Outbox
from feedback.bus.publisher import Publisher
from gateway.assignment import Assignment
from gateway.publishing import InferenceLog
from gateway.relay import Generation
from gateway.routing import ModelSpec
from gateway.tenants import TenantInfo
from reflow.kafka_settings import PublisherConfig
from reflow.settings import Settings
from reflow.v1 import inference_pb2 as P
from tests.support.kafka import Broker
from tests.support.stack import Stack


def test_an_event_over_the_bound_reaches_kafka_cut_to_fit(kafka: Broker, tmp_path: Path) -> None:
    """A long prompt (REFLOW_MAX_PROMPT_CHARS raised for a long-context model) and a long answer."""
    prompt, answer = "1+" * 600_000 + "1=", "6" * 700_000
    generation = Generation(
        P.GenerateRequest(prompt=prompt), TenantInfo(1, "acme", 32, 600), "r-long",
        Assignment(ModelSpec("arith", alias="champion"), "champion"), time.perf_counter(), None,
    )  # fmt: skip
    header = P.GenerateResponse(request_id="r-long", model="arith", model_version="1", arm="champion")
    last = P.GenerateResponse(finish_reason=P.FINISH_REASON_LENGTH, usage=P.Usage(prompt_tokens=20))
    settings = Settings(data_dir=tmp_path)
    publisher = Publisher(kafka.bootstrap, settings.outbox_path, PublisherConfig.from_settings(settings))
    InferenceLog(publisher, settings.max_event_bytes).finished(generation, header, last, answer, "")
    assert publisher.close() == 0
    assert Outbox(settings.outbox_path).dead_letters() == []
    [record] = kafka.read(INFERENCES_TOPIC, 1)
    assert len(record.value) <= settings.max_event_bytes == 900_000
    event = json.loads(record.value)
    assert event["truncated"] is True
    assert prompt.startswith(event["prompt"]) and answer.startswith(event["completion"])
    assert len(event["prompt"]) == len(event["completion"])  # both long: cut to one length


async def test_the_gateway_counts_its_dead_letters(stack: Stack) -> None:
    def dead_letters() -> float | None:
        return stack.metrics.registry.get_sample_value("reflow_gateway_dead_letters")

    assert dead_letters() == 0
    oversized = Record(INFERENCES_TOPIC, b"r-huge", b"x" * 2_000_000)  # over REFLOW_MAX_EVENT_BYTES
    await asyncio.to_thread(stack.publisher.publish, [oversized])
    assert dead_letters() == 1
