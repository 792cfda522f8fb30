"""Shared fixtures: a real MLflow store with a tiny model, and real gateway + worker servers on port 0."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from kafka.consumer.fetcher import ConsumerRecord
from sqlalchemy import Engine as SqlEngine

from feedback.bus.broker import tansu_command, wait_listening
from feedback.bus.kafka import ensure_topics, new_consumer
from feedback.bus.publisher import Publisher
from feedback.intake.consumer import StoreConsumer
from feedback.tasks.arith import Arith
from feedback.training.pretrain import PretrainConfig, train_base_model
from gateway.metrics import GatewayMetrics
from gateway.routing import WorkerPool
from gateway.server import create_server as create_gateway
from gateway.tenants import create_tenant
from reflow.registry import Registry, VersionRef
from reflow.serving import free_port
from reflow.settings import Settings
from reflow.store.database import migrate, open_engine
from reflow.v1 import inference_pb2_grpc, worker_pb2_grpc
from workers.engine import Engine, EngineConfig
from workers.metrics import WorkerMetrics
from workers.models.builtin import TOKENIZER, new_model
from workers.models.interface import CausalLM
from workers.models.loader import save_checkpoint
from workers.server import WorkerServicer
from workers.server import create_server as create_worker
from workers.versions import Versions

MODEL = "arith"


def tiny_model(seed: int = 0) -> CausalLM:
    """A randomly initialised `tiny` model: deterministic for a seed, fast on any CPU."""
    model, _ = new_model("tiny", seed)
    return model.eval()


def reference_greedy(model: CausalLM, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy decoding by full causal passes, no cache: the ground truth for every cached path."""
    tokenizer = TOKENIZER
    ids = tokenizer.encode(prompt)
    banned = tokenizer.never_generated(model.vocab_size)
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + generated]))[0, -1]  # [V]
            logits[banned] = float("-inf")
            token = int(logits.argmax())
            generated.append(token)
            if token in tokenizer.eos_ids:
                break
    return generated


def save_model(model: CausalLM, directory: Path) -> Path:
    """Writes weights, config and tokenizer as a registered version carries them."""
    return save_checkpoint(model, TOKENIZER, directory)


@pytest.fixture(scope="session")
def base_model() -> CausalLM:
    """The demo base model, trained once per session with the default recipe (about a minute)."""
    return train_base_model(PretrainConfig(), Arith())[0]


@dataclass(frozen=True)
class RegistryFixture:
    """A real MLflow store in a temp dir holding `arith` v1 (champion) and v2, both tiny."""

    tracking_uri: str
    artifact_root: str
    champion: VersionRef
    other: VersionRef

    def registry(self) -> Registry:
        return Registry(self.tracking_uri, self.artifact_root)


def local_registry(root: Path, name: str = "mlflow") -> Registry:
    """A real MLflow store under `root`: a SQLite tracking database and local artifacts."""
    return Registry(f"sqlite:///{root / f'{name}.db'}", (root / f"{name}-artifacts").as_uri())


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> RegistryFixture:
    root = tmp_path_factory.mktemp("mlflow")
    registry = local_registry(root)
    versions = []
    for seed, alias in ((0, "champion"), (1, "other")):
        directory = save_model(tiny_model(seed), root / f"model-{seed}")
        versions.append(registry.register(MODEL, directory, params={"seed": seed}, metrics={}, alias=alias))
    return RegistryFixture(registry.tracking_uri, registry.artifact_root or "", *versions)


class Broker:
    """An embedded (Tansu) Kafka broker on a free loopback port that a test can stop and restart."""

    def __init__(self, partitions: int = 3):
        self.port = free_port()
        self.partitions = partitions
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            tansu_command(self.port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_listening("127.0.0.1", self.port)
        ensure_topics(self.bootstrap, self.partitions)

    def read(self, topic: str, count: int, timeout_s: float = 30.0) -> list[ConsumerRecord]:
        """The first `count` records of `topic` (all partitions); fewer if they do not come in time."""
        consumer = new_consumer(self.bootstrap, topic, group_id=None)
        records: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout_s
        while len(records) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=100).values():
                records.extend(batch)
        consumer.close()
        return records

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


@contextlib.contextmanager
def consuming(bootstrap: str, engine: SqlEngine) -> Iterator[StoreConsumer]:
    """A store consumer polling in a thread until the block ends (then it leaves its group)."""
    consumer = StoreConsumer(bootstrap, engine, batch_size=100)
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()
    try:
        yield consumer
    finally:
        stop.set()
        thread.join(30)


@pytest.fixture
def kafka() -> Iterator[Broker]:
    """A fresh broker per test (it starts in well under a second), so no test sees another's records."""
    broker = Broker()
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def settings(tmp_path: Path, mlflow_store: RegistryFixture, kafka: Broker) -> Settings:
    return Settings(
        data_dir=tmp_path,
        kafka_bootstrap=kafka.bootstrap,
        kafka_handover_timeout_s=1.0,
        mlflow_tracking_uri=mlflow_store.tracking_uri,
        mlflow_artifact_root=mlflow_store.artifact_root,
        device="cpu",
        gateway_port=0,
        worker_poll_s=0.2,
        auth_cache_ttl_s=0.5,
        shutdown_grace_s=5.0,
    )


@dataclass
class WorkerUnderTest:
    """An in-process worker server."""

    server: grpc.aio.Server
    servicer: WorkerServicer
    address: str

    @property
    def engine(self) -> Engine:
        return self.servicer.engine


@pytest.fixture
def swap_settings(settings: Settings, tmp_path: Path) -> Settings:
    """A registry of its own (aliases move here): v1 @champion (seed 0) and v2 (seed 1), no alias."""
    registry = local_registry(tmp_path, "swap")
    registry.register(
        MODEL, save_model(tiny_model(0), tmp_path / "v1"), params={}, metrics={}, alias="champion"
    )
    registry.register(
        MODEL, save_model(tiny_model(1), tmp_path / "v2"), params={}, metrics={}, alias="staged"
    )
    registry.delete_alias(MODEL, "staged")  # registering names an alias; v2 is to have none
    return settings.model_copy(
        update={"mlflow_tracking_uri": registry.tracking_uri, "mlflow_artifact_root": registry.artifact_root}
    )


@dataclass
class Stack:
    """A gateway in front of in-process workers, with a tenant's key."""

    settings: Settings
    gateway: grpc.aio.Server
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

    def worker_stub(self, i: int = 0) -> worker_pb2_grpc.WorkerStub:
        channel = grpc.aio.insecure_channel(self.workers[i].address)
        self.extra.append(channel)
        return worker_pb2_grpc.WorkerStub(channel)


async def start_worker(
    settings: Settings,
    alias: str = "champion",
    config: EngineConfig | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> WorkerUnderTest:
    """A worker with `arith@alias` loaded, serving on a free port (over mTLS with `credentials`)."""
    registry = Registry.from_settings(settings)
    versions = Versions(
        Engine(config, WorkerMetrics()), registry, settings.model_cache_dir, torch.device("cpu")
    )
    await versions.load(MODEL, alias=alias)
    servicer = WorkerServicer(versions)
    server, port, _ = await create_worker(servicer, "127.0.0.1", 0, credentials)
    return WorkerUnderTest(server, servicer, f"127.0.0.1:{port}")


async def start_stack(
    settings: Settings,
    n_workers: int = 1,
    extra_addresses: tuple[str, ...] = (),
    engine_config: EngineConfig | None = None,
    **tenant: int,
) -> Stack:
    """Workers, a migrated store with one tenant, and a gateway routing to them."""
    workers = [await start_worker(settings, config=engine_config) for _ in range(n_workers)]
    engine = open_engine(settings.resolved_database_url)
    migrate(engine)
    _, api_key = create_tenant(engine, "acme", **tenant)
    pool = WorkerPool([w.address for w in workers] + list(extra_addresses), settings.worker_poll_s)
    metrics = GatewayMetrics()
    publisher = Publisher(settings.kafka_bootstrap, settings.outbox_path, settings.kafka_handover_timeout_s)
    gateway, port, _ = await create_gateway(settings, pool, metrics, publisher)
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    return Stack(settings, gateway, address, workers, api_key, channel, pool, metrics, publisher)


async def stop_stack(stack: Stack) -> None:
    for channel in [stack.channel, *stack.extra]:
        await channel.close()
    await stack.gateway.stop(0)
    await stack.pool.close()
    stack.publisher.close(timeout_s=2.0)
    for worker in stack.workers:
        with contextlib.suppress(Exception):
            await worker.server.stop(0)
        worker.engine.close()


@pytest.fixture
async def stack(settings: Settings) -> AsyncIterator[Stack]:
    s = await start_stack(settings)
    yield s
    await stop_stack(s)


POSTGRES_ADMIN_URL = os.environ.get(
    "REFLOW_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: SQLite in a temp dir, or a new PostgreSQL database dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"reflow_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as error:
        pytest.skip(f"PostgreSQL unreachable at {POSTGRES_ADMIN_URL} (set REFLOW_TEST_POSTGRES_URL): {error}")
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def store(database_url: str) -> Iterator[SqlEngine]:
    """A migrated store on `database_url`."""
    engine = open_engine(database_url)
    migrate(engine)
    yield engine
    engine.dispose()
