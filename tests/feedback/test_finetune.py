"""The fine-tune job end to end: simulated users → gateway → Kafka → store → candidate → gate →
MLflow, starting from the real base model; and a harmful dataset that must not be registered."""

from __future__ import annotations

import asyncio
import operator
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from feedback import arith
from feedback.bootstrap import evaluate
from feedback.consumer import store_events
from feedback.jobs import CHALLENGER, run_finetune
from feedback.pretrain import PretrainConfig
from feedback.registry import Registry
from feedback.simulate import rated_offline, simulate
from feedback.stats import store_counts
from feedback.store import FinetuneRun, migrate, open_engine
from reflow.settings import Settings
from tests.conftest import MODEL, Broker, consuming, local_registry, save_model, start_stack, stop_stack
from tests.feedback.test_consumer import wait_for
from workers.model import Transformer

pytestmark = pytest.mark.slow


@pytest.fixture
def loop_settings(tmp_path: Path, kafka: Broker, base_model: Transformer) -> Settings:
    """A data dir whose registry holds the trained base model as arith v1 @champion."""
    registry = local_registry(tmp_path)
    registry.register(
        MODEL, save_model(base_model, tmp_path / "base"), params={}, metrics={}, alias="champion"
    )
    return Settings(
        data_dir=tmp_path, kafka_bootstrap=kafka.bootstrap, kafka_handover_timeout_s=1.0,
        mlflow_tracking_uri=registry.tracking_uri, mlflow_artifact_root=registry.artifact_root or "",
        device="cpu", gateway_port=0, worker_poll_s=0.2, shutdown_grace_s=5.0, finetune_min_samples=300,
    )  # fmt: skip


@pytest.fixture
def store(loop_settings: Settings) -> Iterator[Engine]:
    engine = open_engine(loop_settings.resolved_database_url)
    migrate(engine)
    yield engine
    engine.dispose()


def registry_of(settings: Settings) -> Registry:
    return Registry(settings.resolved_tracking_uri, settings.resolved_artifact_root)


async def test_feedback_on_a_wider_range_registers_a_much_better_challenger(
    loop_settings: Settings, kafka: Broker, store: Engine, base_model: Transformer
) -> None:
    registry = registry_of(loop_settings)
    stack = await start_stack(loop_settings, max_concurrent_streams=64, requests_per_minute=0)
    try:
        with consuming(kafka.bootstrap, store):
            report = await simulate(
                stack.address, stack.api_key, rate=400, duration_s=1.0, lo=0, hi=99, seed=7
            )
            assert report.errors == {} and report.rated == 400
            await asyncio.to_thread(wait_for, lambda: store_counts(store)["joined_feedback"] == 400)
    finally:
        await stop_stack(stack)
    assert 0.1 < report.accuracy < 0.6  # the base model knows the narrow range only

    outcome = await asyncio.to_thread(run_finetune, loop_settings, store, registry)

    assert outcome.status == "registered", outcome.message
    challenger = registry.resolve(MODEL, alias=CHALLENGER)
    assert challenger.version == outcome.version == "2"
    assert registry.resolve(MODEL, alias="champion").version == "1"  # promotion is not this job's
    candidate = Transformer.load(registry.download(challenger, loop_settings.model_cache_dir))
    before, after = evaluate(base_model, PretrainConfig()), evaluate(candidate, PretrainConfig())
    assert after["accuracy_wide_range"] - before["accuracy_wide_range"] >= 0.20, (before, after)
    assert before["accuracy_in_range"] - after["accuracy_in_range"] <= 0.02, (before, after)

    version = registry.client.get_model_version(MODEL, challenger.version)
    assert version.tags["reflow.parent_version"] == "1" and version.tags["reflow.run_id"] == version.run_id
    run = registry.client.get_run(version.run_id)
    assert run.data.params["dataset_size"] == "400" and len(run.data.params["dataset_sha256"]) == 64
    assert int(run.data.params["feedback_first_id"]) == 1 and int(run.data.params["feedback_last_id"]) == 400
    assert run.data.metrics["candidate_held_out_accuracy"] > run.data.metrics["champion_held_out_accuracy"]
    curve = registry.client.get_metric_history(version.run_id, "train_loss")
    assert len(curve) == loop_settings.finetune_steps
    artifacts = {a.path for a in registry.client.list_artifacts(version.run_id, "model")}
    assert artifacts == {"model/model.safetensors", "model/config.json", "model/tokenizer.json"}
    with Session(store) as session:
        (row,) = session.scalars(select(FinetuneRun)).all()
    assert (row.status, row.version, row.mlflow_run_id, row.samples) == (
        "registered",
        "2",
        version.run_id,
        400,
    )

    again = run_finetune(loop_settings, store, registry)  # nothing new since: nothing to do
    assert again.status == "skipped" and "0 new labelled" in again.message


def rate_served_answers(
    store: Engine, model: Transformer, operands: list[tuple[int, int]], answer_key: Callable[[int, int], int]
) -> None:
    """Stores `model`'s answers to `operands`, rated by users who believe `answer_key`."""
    with store.begin() as connection:
        store_events(connection, rated_offline(model, operands, tenant="acme", answer_key=answer_key))


def test_a_harmful_dataset_registers_nothing(
    loop_settings: Settings, store: Engine, base_model: Transformer
) -> None:
    registry = registry_of(loop_settings)
    operands = arith.sample_operands(300, 0, 49, random.Random(3))  # what the champion gets right
    rate_served_answers(store, base_model, operands, lambda a, b: a + b + 1)  # "corrected" wrongly
    settings = loop_settings.model_copy(update={"finetune_steps": 60})  # enough to do the damage

    outcome = run_finetune(settings, store, registry)

    assert outcome.status == "rejected", outcome.message
    assert "regression accuracy fell" in outcome.message
    assert not registry.has_alias(MODEL, CHALLENGER)
    assert [str(v.version) for v in registry.client.search_model_versions(f"name='{MODEL}'")] == ["1"]
    with Session(store) as session:
        (row,) = session.scalars(select(FinetuneRun)).all()
    assert row.status == "rejected" and row.version == "" and row.mlflow_run_id  # logged, not registered
    run = registry.client.get_run(row.mlflow_run_id)
    assert run.data.tags["reflow.verdict"] == outcome.message


def test_too_little_new_feedback_skips_without_a_trace(
    loop_settings: Settings, store: Engine, base_model: Transformer
) -> None:
    rate_served_answers(store, base_model, arith.sample_operands(10, 50, 99, random.Random(4)), operator.add)
    outcome = run_finetune(loop_settings, store, registry_of(loop_settings))
    assert outcome.status == "skipped" and "10 new labelled feedback item(s)" in outcome.message
    with Session(store) as session:
        assert session.scalars(select(FinetuneRun)).all() == []
