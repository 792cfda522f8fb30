"""The gateway process: the public Inference service's gRPC face (each RPC a few lines over the
InferenceService), the OpenAI HTTP face beside it on the same event loop, and their drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health
from kafka.errors import KafkaError

from feedback.bus.kafka import ensure_topics, resolve_bootstrap
from feedback.bus.publisher import Publisher
from feedback.events import FEEDBACK_FIELDS
from gateway.assignment import ASSIGNMENT_KEY, ExperimentView
from gateway.auth import Authenticator
from gateway.edge import EdgeLimits
from gateway.grpc_keys import KeyCheck, caller
from gateway.http.app import create_app
from gateway.http.server import HttpServer
from gateway.intake import FeedbackIntake
from gateway.latency import LatencyModel
from gateway.metrics import GatewayMetrics
from gateway.placement import Placer
from gateway.publishing import InferenceLog
from gateway.quotas import LocalQuotas, Quotas
from gateway.relay import CACHE_SALT_KEY, Relay
from gateway.routing import ModelSpec, WorkerPool
from gateway.service import InferenceService
from gateway.shared_level import RedisConfig, SharedLevel
from gateway.shared_quotas import SharedQuotas
from gateway.validation import RequestLimits
from reflow.cgroups import join_gateway_group
from reflow.errors import ReflowError
from reflow.gateway_tls import GatewayTls
from reflow.kafka_settings import PublisherConfig
from reflow.mtls import TlsFiles, channel_credentials
from reflow.private_files import private_dir
from reflow.request_ids import RequestIds
from reflow.serving import (
    bind,
    host_port,
    new_server,
    set_serving,
    start_metrics_server,
    stop_signal,
    write_ready_file,
)
from reflow.settings import Settings
from reflow.store.database import open_db, require_current_schema
from reflow.store.secrets import shared_secret
from reflow.v1 import inference_pb2, inference_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """The gRPC face: streams completions, takes feedback on them, lists models, for the caller
    whose key KeyCheck checked."""

    def __init__(self, service: InferenceService):
        self.service = service

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        received = time.perf_counter()
        generation = self.service.start(caller(), request, context.time_remaining(), received)
        await context.send_initial_metadata((("x-request-id", generation.request_id),))
        async with contextlib.aclosing(self.service.stream(generation)) as stream:
            async for message in stream:
                yield message

    async def SubmitFeedback(
        self, request_iterator: AsyncIterator[inference_pb2.Feedback], context: grpc.aio.ServicerContext
    ) -> inference_pb2.FeedbackAck:
        items = (_fields(item) async for item in request_iterator)
        result = await self.service.submit_feedback(caller(), items)
        ack = inference_pb2.FeedbackAck(accepted=result.accepted, rejected=result.rejected)
        for e in result.errors:
            ack.errors.add(index=e.index, feedback_id=e.feedback_id, reason=e.reason, code=e.code)
        return ack

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        response = inference_pb2.ListModelsResponse()
        for name, versions in self.service.served_models(caller()):
            model = response.models.add(name=name)
            for v in versions:
                served = model.versions.add(
                    version=v.version, aliases=v.aliases, ready_workers=v.ready_workers
                )
                served.variants.extend(v.variants.values())
        return response


def _fields(item: inference_pb2.Feedback) -> dict[str, object]:
    """The fields of a Feedback message, as feedback intake validates them."""
    return {name: getattr(item, name) for name in FEEDBACK_FIELDS} | {"labels": dict(item.labels)}


def request_limits(settings: Settings) -> RequestLimits:
    """What the gateway accepts of a request, from REFLOW_MAX_PROMPT_CHARS and its neighbours."""
    return RequestLimits(settings.max_prompt_chars, settings.default_max_tokens, settings.max_stop_strings)


def edge_limits(settings: Settings) -> EdgeLimits:
    """What each public face grants a caller, from REFLOW_MAX_REQUEST_BYTES and its neighbours."""
    return EdgeLimits(
        settings.max_request_bytes, settings.max_concurrent_requests, settings.header_timeout_s,
        settings.auth_failures_per_minute,
    )  # fmt: skip


def grpc_bounds(edge: EdgeLimits) -> list[tuple[str, int]]:
    """The gRPC port's channel arguments for `edge`: messages up to its bound, and HTTP/2 windows
    that grow only as a call reads (no bandwidth-delay probe), so that the message of a call whose
    key is refused is never received past the first 64 KiB."""
    return [("grpc.max_receive_message_length", edge.max_request_bytes), ("grpc.http2.bdp_probe", 0)]


def redis_config(settings: Settings) -> RedisConfig | None:
    """The shared level of replicas' key and quota caches; None without REFLOW_REDIS_URL."""
    if not settings.redis_url:
        return None
    return RedisConfig(
        settings.redis_url, settings.redis_prefix, settings.redis_timeout_s, settings.redis_key_ttl_s
    )


def quotas_of(settings: Settings, shared: SharedLevel | None, metrics: GatewayMetrics) -> Quotas:
    """Quotas in Redis across replicas with a shared level (per replica while it is down), else in
    this process; every refusal counted by quota."""
    local = LocalQuotas(refused=lambda quota: metrics.quota_refusals.labels(quota).inc())
    if shared is None:
        return local
    metrics.redis_up.set_function(lambda: shared.available)
    return SharedQuotas(shared, settings.redis_lease_s, local)


@dataclass
class Gateway:
    """A started gateway's two faces over one InferenceService: gRPC and the OpenAI HTTP API."""

    grpc: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    http: HttpServer
    service: InferenceService
    shared: SharedLevel | None

    @property
    def http_port(self) -> int:
        return self.http.port

    async def drain(self, grace_s: float) -> None:
        """Stops taking calls on both faces (gRPC health says so at once; the HTTP port closes) and
        lets open streams finish within `grace_s`; then closes the caches' shared level."""
        await set_serving(self.health, [SERVICE], False)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self.grpc.stop(grace_s), self.http.stop())
        await self.service.close()
        if self.shared is not None:
            await self.shared.close()


async def create_server(
    settings: Settings, pool: WorkerPool, metrics: GatewayMetrics, publisher: Publisher
) -> Gateway:
    """A started gateway on the configured host, its gRPC and HTTP ports."""
    db = open_db(settings.resolved_database_url)
    require_current_schema(db)
    config = redis_config(settings)
    shared = None if config is None else SharedLevel(config)
    edge = edge_limits(settings)
    auth = Authenticator(
        db, settings.auth_cache_ttl_s, shared=shared, failures_per_minute=edge.auth_failures_per_minute
    )
    quotas = quotas_of(settings, shared, metrics)
    request_ids = RequestIds.from_store(db)
    experiments = ExperimentView(db, settings.worker_poll_s, shared_secret(db, ASSIGNMENT_KEY))
    await experiments.refresh()
    limits = request_limits(settings)
    placer = Placer(pool, LatencyModel(), limits, settings.reasoning_budget_floor)
    relay = Relay(pool, metrics, limits, placer, shared_secret(db, CACHE_SALT_KEY))
    service = InferenceService(
        auth=auth, quotas=quotas, limits=limits, pool=pool, experiments=experiments, relay=relay,
        log=InferenceLog(publisher, settings.max_event_bytes),
        intake=FeedbackIntake(request_ids, publisher, metrics, settings.max_feedback_items),
        request_ids=request_ids, default_model=ModelSpec(settings.model_name, alias=settings.model_alias),
    )  # fmt: skip
    metrics.outbox.set_function(lambda: publisher.pending)
    metrics.dead_letters.set_function(lambda: publisher.dead_letters)
    server, health_servicer = new_server(
        [SERVICE], on_done=metrics.count_request, gates=[KeyCheck(SERVICE, service.authenticate)],
        options=grpc_bounds(edge), max_concurrent_rpcs=edge.max_concurrent_requests,
    )  # fmt: skip
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(service), server)
    tls = GatewayTls.from_settings(settings)
    credentials = None if tls is None else tls.server_credentials()
    moved_by = "REFLOW_GATEWAY_PORT (--port)"  # named when the port is taken
    port = bind(server, settings.gateway_host, settings.gateway_port, credentials, setting=moved_by)
    app = create_app(service, metrics, edge)
    http = HttpServer(app, settings.gateway_host, settings.http_port, settings.shutdown_grace_s, edge, tls)
    await pool.start()
    await server.start()
    await http.start()
    auth.start()
    await set_serving(health_servicer, [SERVICE], True)
    return Gateway(server, port, health_servicer, http, service, shared)


async def serve(settings: Settings, *, ready_file: Path | None = None) -> None:
    """`reflow gateway`: serve until SIGINT/SIGTERM, then drain in-flight streams."""
    if not settings.workers:
        raise ReflowError("no workers configured; set REFLOW_WORKERS=host:port[,host:port]")
    # first, so every socket it makes is the gateway's
    if settings.isolation != "none" and join_gateway_group(settings.data_dir):
        logger.info("gateway in the cgroup isolated workers admit")
    private_dir(settings.data_dir)  # the outbox's, and an embedded store's
    bootstrap = resolve_bootstrap(settings.kafka_bootstrap, settings.data_dir)
    kafka = PublisherConfig.from_settings(settings)
    try:
        await asyncio.to_thread(ensure_topics, bootstrap, settings.kafka_partitions, security=kafka.security)
    except KafkaError as error:  # serve anyway: events wait in the outbox until Kafka answers
        logger.warning("could not reach Kafka at %s (%s); events go to the outbox for now", bootstrap, error)
    publisher = Publisher(bootstrap, settings.outbox_path, kafka)
    pool = WorkerPool(
        settings.workers, settings.worker_poll_s, channel_credentials(TlsFiles.from_settings(settings))
    )
    metrics = GatewayMetrics(settings.metrics_max_tenants)
    metrics_server, metrics_url = start_metrics_server(  # first: a port taken leaves no gRPC server behind
        metrics.registry, settings.metrics_host, settings.gateway_metrics_port,
        setting="REFLOW_GATEWAY_METRICS_PORT",
    )  # fmt: skip
    gateway = await create_server(settings, pool, metrics, publisher)
    address = host_port(settings.gateway_host, gateway.port)
    http_url = f"{gateway.http.scheme}://{host_port(settings.gateway_host, gateway.http_port)}"
    logger.info(
        "gateway serving gRPC on %s and HTTP on %s, workers %s, metrics %s",
        address, http_url, settings.workers, metrics_url,
    )  # fmt: skip
    stopped = stop_signal()
    write_ready_file(ready_file, address=address, http=http_url, metrics=metrics_url)
    await stopped
    logger.info("gateway draining (grace %.0fs)", settings.shutdown_grace_s)
    await gateway.drain(settings.shutdown_grace_s)
    await pool.close()
    await asyncio.to_thread(publisher.close, settings.shutdown_grace_s)
    metrics_server.shutdown()
