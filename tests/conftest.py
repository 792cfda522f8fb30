"""The fixtures every test may ask for: a real MLflow store with tiny models, a Kafka broker, settings
pointing at them, a gateway in front of in-process workers, SQLite and PostgreSQL stores, and what
is built once per run and shared (tests/support/shared.py): the trained demo base model and its
cheerful twin, SmolLM2 converted from its GGUF file by reflow and as transformers reads it, a tiny
chat model. What they are built from lives in tests/support/."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import safetensors.torch
from sqlalchemy import Engine

from feedback.tasks import get_task
from feedback.training.pretrain import PretrainConfig, train_base_model
from reflow.cgroups import IsolationUnavailable
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from tests.support.cheerful import Cheerful
from tests.support.hf import transformers
from tests.support.kafka import Broker
from tests.support.models import MODEL, save_model, tiny_model
from tests.support.redis import MACHINE_REDIS, RedisServer, SharedRedis, forget, unique_prefix
from tests.support.registry import RegistryFixture, local_registry
from tests.support.shared import built_once
from tests.support.smollm2 import converted_smollm2, smollm2_gguf, tiny_chat_checkpoint, tiny_qwen3_checkpoint
from tests.support.stack import Stack, start_stack, stop_stack
from tests.support.store import postgres_database
from workers.isolation.host import DEFAULT_OBJECT, check_host
from workers.models.interface import CausalLM
from workers.models.loader import load_checkpoint


@pytest.fixture(scope="session")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """The demo base model, trained once per run with the default recipe (about a minute)."""

    def train(directory: Path) -> None:
        save_model(train_base_model(PretrainConfig(), get_task("arith"))[0], directory)

    return load_checkpoint(built_once(tmp_path_factory, "base-model", train))[0]


@pytest.fixture(scope="session")
def cheerful_model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """The demo model trained on `Cheerful` sums (tests/support/cheerful.py): it ends about half of
    its answers with "!", which its users like. Trained once per run, as the base model is."""

    def train(directory: Path) -> None:
        save_model(train_base_model(PretrainConfig(), Cheerful())[0], directory)

    return load_checkpoint(built_once(tmp_path_factory, "cheerful-model", train))[0]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as the Hugging Face checkpoint reflow converts its GGUF file into."""
    return built_once(tmp_path_factory, "smollm2", converted_smollm2)


@pytest.fixture(scope="session")
def smollm2_by_transformers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's GGUF file as transformers reads it (float32 weights and tokenizer), saved by
    transformers: the reference reflow's conversion is held to. Reading the file dequantizes it in
    Python, ~40 s each time; loading what it saved takes a second."""

    def read(directory: Path) -> None:
        gguf = smollm2_gguf()
        model = transformers().AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        del model.config.quantization_config  # dequantized as it was read: float32 weights, saved so
        model.config.save_pretrained(directory)
        safetensors.torch.save_model(model, str(directory / "model.safetensors"))  # save_pretrained refuses
        tokenizer = transformers().AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(directory)

    return built_once(tmp_path_factory, "smollm2-by-transformers", read)


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (tiny_chat_checkpoint)."""
    return built_once(
        tmp_path_factory, "tiny-chat", lambda directory: tiny_chat_checkpoint(smollm2, directory)
    )


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2: Path) -> Path:
    """A tiny random Qwen3 with SmolLM2's tokenizer and Qwen3's chat template (tiny_qwen3_checkpoint)."""
    return built_once(
        tmp_path_factory, "tiny-qwen3", lambda directory: tiny_qwen3_checkpoint(smollm2, directory)
    )


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> RegistryFixture:
    """`arith` v1 (@champion, seed 0) and v2 (@other, seed 1), both tiny, in a real MLflow store."""
    root = tmp_path_factory.mktemp("mlflow")
    registry = local_registry(root)
    versions = []
    for seed, alias in ((0, "champion"), (1, "other")):
        directory = save_model(tiny_model(seed), root / f"model-{seed}")
        versions.append(registry.register(MODEL, directory, params={"seed": seed}, metrics={}, alias=alias))
    return RegistryFixture(registry.tracking_uri, registry.artifact_root or "", *versions)


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
        # the outputs tests compare are float32's: what REFLOW_DTYPE=auto serves a Llama-family model
        # in depends on how fast this machine runs each dtype (tests/workers/test_dtype_choice.py)
        dtype="float32",
        gateway_port=0,
        http_port=0,
        worker_poll_s=0.2,
        auth_cache_ttl_s=0.5,
        shutdown_grace_s=5.0,
    )


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


@pytest.fixture
async def stack(settings: Settings) -> AsyncIterator[Stack]:
    s = await start_stack(settings)
    yield s
    await stop_stack(s)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database: SQLite in a temp dir, or a new PostgreSQL database dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    with postgres_database() as url:
        yield url


@pytest.fixture(scope="module")
def isolation_host() -> None:
    """For the tests of isolated workers: skipped, saying why, where the host cannot isolate them."""
    try:
        check_host(DEFAULT_OBJECT)
    except IsolationUnavailable as error:
        pytest.skip(f"worker isolation cannot run here: {error}")


@pytest.fixture
def shared_redis() -> Iterator[SharedRedis]:
    """The machine's Redis under a key prefix of this test's own; every key under it is deleted
    afterwards."""
    shared = SharedRedis(os.environ.get("REFLOW_TEST_REDIS_URL", MACHINE_REDIS), unique_prefix())
    try:
        forget(shared)
    except redis.RedisError as error:
        pytest.skip(f"Redis unreachable at {shared.url} (set REFLOW_TEST_REDIS_URL): {error}")
    yield shared
    forget(shared)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own, started; the test may stop and restart it."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def store(database_url: str) -> Iterator[Engine]:
    """A migrated store on `database_url`."""
    db = open_db(database_url)
    migrate(db)
    yield db
    db.dispose()
