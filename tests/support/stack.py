"""In-process servers on free ports: workers with the tiny model, and a gateway in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from feedback.bus.publisher import Publisher
from gateway.metrics import GatewayMetrics
from gateway.routing import WorkerPool
from gateway.server import Gateway
from gateway.server import create_server as create_gateway
from gateway.tenants import Limits, create_tenant
from reflow.gateway_tls import client_credentials
from reflow.kafka_settings import PublisherConfig
from reflow.mtls import open_channel
from reflow.registry import Registry
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from reflow.store.tables import TRAINS_SHARED
from reflow.v1 import inference_pb2, inference_pb2_grpc, worker_pb2_grpc
from tests.support.models import MODEL
from tests.support.waiting import eventually
from workers.engine import Engine, EngineConfig
from workers.metrics import WorkerMetrics
from workers.models.loader import resolve_dtype
from workers.server import WorkerServicer
from workers.server import create_server as create_worker
from workers.versions import Versions


@dataclass
class WorkerUnderTest:
    """An in-process worker server."""

    server: grpc.aio.Server
    servicer: WorkerServicer
    address: str

    @property
    def engine(self) -> Engine:
        return self.servicer.engine


@dataclass
class Stack:
    """A gateway in front of in-process workers, with a tenant's key."""

    settings: Settings
    gateway: Gateway
    address: str
    workers: list[WorkerUnderTest]
    api_key: str
    channel: grpc.aio.Channel
    pool: WorkerPool
    metrics: GatewayMetrics
    publisher: Publisher
    extra: list[grpc.aio.Channel] = field(default_factory=list)

    @property
    def stub(self) -> inference_pb2_grpc.InferenceStub:
        return inference_pb2_grpc.InferenceStub(self.channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),)

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (`.../v1` is what the `openai` SDK takes)."""
        return f"{self.gateway.http.scheme}://127.0.0.1:{self.gateway.http_port}"

    def worker_stub(self, i: int = 0) -> worker_pb2_grpc.WorkerStub:
        channel = grpc.aio.insecure_channel(self.workers[i].address)
        self.extra.append(channel)
        return worker_pb2_grpc.WorkerStub(channel)


async def start_worker(
    settings: Settings,
    alias: str = "champion",
    config: EngineConfig | None = None,
    credentials: grpc.ServerCredentials | None = None,
    model: str = MODEL,
) -> WorkerUnderTest:
    """A worker with `model@alias` loaded, serving on a free port (over mTLS with `credentials`)."""
    registry = Registry.from_settings(settings)
    engine = Engine(config, WorkerMetrics())
    cpu = torch.device("cpu")
    dtype = resolve_dtype(settings.dtype)
    versions = Versions(engine, registry, settings.model_cache_dir, cpu, dtype, tuple(settings.variants))
    await versions.load(model, alias=alias)
    servicer = WorkerServicer(versions)
    server, port, _ = await create_worker(servicer, "127.0.0.1", 0, credentials)
    return WorkerUnderTest(server, servicer, f"127.0.0.1:{port}")


async def start_stack(
    settings: Settings,
    n_workers: int = 1,
    extra_addresses: tuple[str, ...] = (),
    engine_config: EngineConfig | None = None,
    model: str = MODEL,
    **tenant: int,
) -> Stack:
    """Workers serving `model`, a migrated store with one tenant (in the shared model, as one team
    serving its own users is), and a gateway routing to them
    (over TLS when the settings give it a certificate; the stack's channel trusts
    REFLOW_GATEWAY_CA_FILE)."""
    workers = [await start_worker(settings, config=engine_config, model=model) for _ in range(n_workers)]
    db = open_db(settings.resolved_database_url)
    migrate(db)
    _, api_key = create_tenant(db, "acme", limits=Limits(**tenant), trains=TRAINS_SHARED)
    pool = WorkerPool([w.address for w in workers] + list(extra_addresses), settings.worker_poll_s)
    metrics = GatewayMetrics()
    publisher = Publisher(
        settings.kafka_bootstrap, settings.outbox_path, PublisherConfig.from_settings(settings)
    )
    gateway = await create_gateway(settings, pool, metrics, publisher)
    address = f"127.0.0.1:{gateway.port}"
    channel = open_channel(address, client_credentials(settings.gateway_ca_file), grpc.aio)
    return Stack(settings, gateway, address, workers, api_key, channel, pool, metrics, publisher)


async def start_replica(stack: Stack) -> Stack:
    """Another gateway replica in front of the stack's workers, on the same settings and store (so
    the same tenant); stopping it leaves the workers to the stack."""
    settings = stack.settings
    pool = WorkerPool([w.address for w in stack.workers], settings.worker_poll_s)
    metrics = GatewayMetrics()
    outbox = settings.data_dir / f"outbox-{uuid.uuid4().hex[:8]}.db"  # each replica has its own disk
    publisher = Publisher(settings.kafka_bootstrap, outbox, PublisherConfig.from_settings(settings))
    gateway = await create_gateway(settings, pool, metrics, publisher)
    address = f"127.0.0.1:{gateway.port}"
    channel = open_channel(address, client_credentials(settings.gateway_ca_file), grpc.aio)
    return Stack(settings, gateway, address, [], stack.api_key, channel, pool, metrics, publisher)


async def stop_stack(stack: Stack) -> None:
    for channel in [stack.channel, *stack.extra]:
        await channel.close()
    await stack.gateway.drain(0)
    await stack.pool.close()
    stack.publisher.close(timeout_s=2.0)
    for worker in stack.workers:
        with contextlib.suppress(Exception):
            await worker.server.stop(0)
        worker.engine.close()


def request(prompt: str = "47+38=", max_tokens: int = 12, **kw: object) -> inference_pb2.GenerateRequest:
    """A GenerateRequest for `prompt` with `max_tokens`, and any other GenerateRequest fields."""
    sampling = inference_pb2.SamplingParams(max_tokens=max_tokens)
    return inference_pb2.GenerateRequest(prompt=prompt, sampling=sampling, **kw)


async def generate(
    stack: Stack, req: inference_pb2.GenerateRequest, **kw: object
) -> list[inference_pb2.GenerateResponse]:
    """Every message of one Generate call through the stack's gateway."""
    return [m async for m in stack.stub.Generate(req, metadata=stack.metadata, **kw)]


@contextlib.asynccontextmanager
async def held_stream(stack: Stack) -> AsyncIterator[None]:
    """A Generate stream that holds one of the tenant's stream slots for the block: the engine is
    stalled before the stream reaches it, so even a fast model cannot finish it (and free the slot)
    early. (Stalled after its first message instead, a loaded machine once let the engine finish
    the stream first: the slot came free, and the request that should have been refused hung.)"""
    engine = stack.workers[0].engine
    release, stalled = threading.Event(), threading.Event()

    def stall() -> None:
        stalled.set()
        release.wait()

    stalling = asyncio.create_task(asyncio.to_thread(engine.run, stall))
    call = None
    try:
        await eventually(stalled.is_set, what="the engine to stall")
        call = stack.stub.Generate(request(max_tokens=60), metadata=stack.metadata)
        await eventually(lambda: engine.waiting == 1, what="the held stream to reach the stalled engine")
        yield
    finally:
        release.set()
        await stalling
        if call is not None:
            call.cancel()
