"""The public Inference service: each RPC a few lines over auth, quotas, assignment, the relay, the
inference log and feedback intake; and the gateway process around it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health
from kafka.errors import KafkaError

from feedback.bus.kafka import ensure_topics, resolve_bootstrap
from feedback.bus.publisher import Publisher
from feedback.events import FEEDBACK_FIELDS
from gateway.assignment import ExperimentView
from gateway.auth import Authenticator
from gateway.intake import FeedbackIntake
from gateway.metrics import GatewayMetrics
from gateway.publishing import InferenceLog
from gateway.quotas import Quotas
from gateway.relay import Generation, Relay, deadline_of
from gateway.routing import ModelSpec, WorkerPool
from gateway.validation import RequestLimits, check_request
from reflow.cgroups import join_gateway_group
from reflow.errors import InvalidArgument, ReflowError
from reflow.mtls import TlsFiles, channel_credentials
from reflow.request_ids import RequestIds
from reflow.serving import (
    bind,
    host_port,
    new_server,
    set_serving,
    start_metrics_server,
    wait_for_signal,
    write_ready_file,
)
from reflow.settings import Settings
from reflow.store.database import open_engine, require_current_schema
from reflow.v1 import inference_pb2, inference_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Streams completions (publishing an event for each), takes feedback on them, lists models."""

    def __init__(
        self,
        auth: Authenticator,
        quotas: Quotas,
        limits: RequestLimits,
        pool: WorkerPool,
        experiments: ExperimentView,
        relay: Relay,
        log: InferenceLog,
        intake: FeedbackIntake,
        request_ids: RequestIds,
        default_model: ModelSpec,
    ):
        self.auth = auth
        self.quotas = quotas
        self.limits = limits
        self.pool = pool
        self.experiments = experiments
        self.relay = relay
        self.log = log
        self.intake = intake
        self.request_ids = request_ids
        self.default_model = default_model  # what a request that names no model gets

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        received = time.perf_counter()
        tenant = await self.auth.authenticate(context)
        check_request(request, self.limits)
        spec = ModelSpec.parse(request.model, self.default_model.name, self.default_model.alias)
        request_id = self.request_ids.new(tenant.name)
        await context.send_initial_metadata((("x-request-id", request_id),))
        unit = request.user_id or request_id  # what the arm sticks to
        assignment = self.experiments.assign(request.model, spec, unit, self.pool)
        deadline = deadline_of(context.time_remaining(), request.latency_budget_ms, received)
        generation = Generation(request, tenant, request_id, assignment, received, deadline)
        with self.quotas.admit(tenant):
            try:
                # aclosing: cleanup (quota, outstanding counts, the worker call) runs at once on cancel
                stream = self.relay.stream(generation, functools.partial(self.log.finished, generation))
                async with contextlib.aclosing(stream):
                    async for message in stream:
                        yield message
            except ReflowError as error:
                # the error-rate guardrail counts failures of the arm, not a request the model
                # could never take (e.g. a prompt longer than its context)
                if assignment.experiment is not None and not isinstance(error, InvalidArgument):
                    self.log.failed(generation)
                raise

    async def SubmitFeedback(
        self, request_iterator: AsyncIterator[inference_pb2.Feedback], context: grpc.aio.ServicerContext
    ) -> inference_pb2.FeedbackAck:
        tenant = await self.auth.authenticate(context)
        result = await self.intake.submit(tenant.name, (_fields(item) async for item in request_iterator))
        ack = inference_pb2.FeedbackAck(accepted=result.accepted, rejected=result.rejected)
        for e in result.errors:
            ack.errors.add(index=e.index, feedback_id=e.feedback_id, reason=e.reason, code=e.code)
        return ack

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        await self.auth.authenticate(context)
        response = inference_pb2.ListModelsResponse()
        for name, versions in sorted(self.pool.served_versions().items()):
            model = response.models.add(name=name)
            for version, (aliases, ready) in sorted(versions.items(), key=lambda kv: int(kv[0])):
                model.versions.add(version=version, aliases=sorted(aliases), ready_workers=ready)
        return response


def _fields(item: inference_pb2.Feedback) -> dict[str, object]:
    """The fields of a Feedback message, as feedback intake validates them."""
    return {name: getattr(item, name) for name in FEEDBACK_FIELDS} | {"labels": dict(item.labels)}


def request_limits(settings: Settings) -> RequestLimits:
    """What the gateway accepts of a request, from REFLOW_MAX_PROMPT_CHARS and its neighbours."""
    return RequestLimits(settings.max_prompt_chars, settings.default_max_tokens, settings.max_stop_strings)


async def create_server(
    settings: Settings, pool: WorkerPool, metrics: GatewayMetrics, publisher: Publisher
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """A started gateway on the configured host and port; returns (server, port, health servicer)."""
    engine = open_engine(settings.resolved_database_url)
    require_current_schema(engine)
    auth = Authenticator(engine, settings.auth_cache_ttl_s)
    request_ids = RequestIds.from_store(engine)
    experiments = ExperimentView(engine, settings.worker_poll_s)
    await experiments.refresh()
    limits = request_limits(settings)
    servicer = InferenceServicer(
        auth, Quotas(), limits, pool, experiments, Relay(pool, metrics, limits), InferenceLog(publisher),
        FeedbackIntake(request_ids, publisher, metrics), request_ids,
        ModelSpec(settings.model_name, alias=settings.model_alias),
    )  # fmt: skip
    metrics.outbox.set_function(lambda: publisher.pending)
    server, health_servicer = new_server([SERVICE], on_done=metrics.count_request)
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = bind(server, settings.gateway_host, settings.gateway_port)
    await pool.start()
    await server.start()
    await set_serving(health_servicer, [SERVICE], True)
    return server, port, health_servicer


async def serve(settings: Settings, *, ready_file: Path | None = None) -> None:
    """`reflow gateway`: serve until SIGINT/SIGTERM, then drain in-flight streams."""
    if not settings.workers:
        raise ReflowError("no workers configured; set REFLOW_WORKERS=host:port[,host:port]")
    # first, so every socket it makes is the gateway's
    if settings.isolation != "none" and join_gateway_group(settings.data_dir):
        logger.info("gateway in the cgroup isolated workers admit")
    bootstrap = resolve_bootstrap(settings.kafka_bootstrap, settings.data_dir)
    try:
        await asyncio.to_thread(ensure_topics, bootstrap, settings.kafka_partitions)
    except KafkaError as error:  # serve anyway: events wait in the outbox until Kafka answers
        logger.warning("could not reach Kafka at %s (%s); events go to the outbox for now", bootstrap, error)
    publisher = Publisher(bootstrap, settings.outbox_path, settings.kafka_handover_timeout_s)
    pool = WorkerPool(
        settings.workers, settings.worker_poll_s, channel_credentials(TlsFiles.from_settings(settings))
    )
    metrics = GatewayMetrics()
    server, port, health_servicer = await create_server(settings, pool, metrics, publisher)
    metrics_server, metrics_url = start_metrics_server(
        metrics.registry, settings.gateway_host, settings.gateway_metrics_port
    )
    address = host_port(settings.gateway_host, port)
    logger.info("gateway serving on %s, workers %s, metrics %s", address, settings.workers, metrics_url)
    write_ready_file(ready_file, address=address, metrics=metrics_url)
    await wait_for_signal()
    logger.info("gateway draining (grace %.0fs)", settings.shutdown_grace_s)
    await set_serving(health_servicer, [SERVICE], False)
    with contextlib.suppress(asyncio.CancelledError):
        await server.stop(settings.shutdown_grace_s)
    await pool.close()
    await asyncio.to_thread(publisher.close, settings.shutdown_grace_s)
    metrics_server.shutdown()
