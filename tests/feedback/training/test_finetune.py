"""The fine-tune job from the real base model: a helpful dataset registers a challenger with its run
and its lineage; a harmful one is logged and not registered; too little feedback leaves no trace.
(The whole path from users to a promoted challenger, served, is tests/test_loop.py.)"""

from __future__ import annotations

import operator
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from feedback.intake.consumer import store_events
from feedback.job_scheduler import finetune_job_of
from feedback.tasks import arith
from feedback.tasks.arith import Arith
from feedback.tasks.simulate import rated_offline
from feedback.training.dataset import count_new
from feedback.training.job import Cancelled, run_finetune
from feedback.training.trainer import FinetuneConfig
from reflow.registry import BASE_VERSION_TAG, CHALLENGER, TASK_SCORE_TAG, Registry
from reflow.settings import Settings
from reflow.store.tables import FinetuneRun
from tests.support.models import MODEL, save_model
from tests.support.registry import settings_with_champion
from tests.support.store import migrated_store
from workers.models.builtin import TOKENIZER
from workers.models.interface import CausalLM

# whole fine-tune rounds: one took all of the suite's 300 s on 2 cores of a 2 GHz AVX2 EPYC
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def loop_settings(tmp_path: Path, base_model: CausalLM) -> Settings:
    """A data dir whose registry holds the trained base model as arith v1 @champion."""
    base = save_model(base_model, tmp_path / "base")
    return settings_with_champion(tmp_path, MODEL, base, task="arith", finetune_min_samples=300)


@pytest.fixture
def store(loop_settings: Settings) -> Iterator[Engine]:
    yield from migrated_store(loop_settings.resolved_database_url)


def rate_served_answers(
    store: Engine, model: CausalLM, operands: list[tuple[int, int]], answer_key: Callable[[int, int], int]
) -> None:
    """Stores `model`'s answers to `operands`, rated by users who believe `answer_key`."""

    def believed(prompt: str) -> str:
        a, b = arith.parse_prompt(prompt) or (0, 0)
        return str(answer_key(a, b))

    prompts = [arith.format_prompt(a, b) for a, b in operands]
    events = rated_offline(model, TOKENIZER, Arith(), prompts, tenant="acme", answer_key=believed)
    with store.begin() as connection:
        store_events(connection, events)


def test_a_helpful_dataset_registers_a_challenger_with_its_run_and_lineage(
    loop_settings: Settings, store: Engine, base_model: CausalLM
) -> None:
    registry = Registry.from_settings(loop_settings)
    operands = arith.sample_operands(300, 0, 99, random.Random(4))  # traffic's range: often wrong
    rate_served_answers(store, base_model, operands, operator.add)
    settings = loop_settings.model_copy(update={"variants": ["int8"]})  # the default recipe

    outcome = run_finetune(finetune_job_of(settings), store, registry)

    assert outcome.status == "registered", outcome.message
    challenger = registry.resolve(MODEL, alias=CHALLENGER)
    version = registry.client.get_model_version(MODEL, challenger.version)
    assert version.tags["reflow.parent_version"] == "1" and version.tags["reflow.run_id"] == version.run_id
    scores = [float(version.tags[tag]) for tag in (TASK_SCORE_TAG, f"{TASK_SCORE_TAG}.int8")]
    assert all(0.0 < score <= 1.0 for score in scores)  # what the int8 variant's workers will report
    with Session(store) as session:
        (run,) = session.scalars(select(FinetuneRun)).all()
    assert (run.status, run.version, run.mlflow_run_id) == ("registered", challenger.version, version.run_id)
    assert (run.first_feedback_id, run.samples) == (1, 300)
    mlflow_run = registry.client.get_run(version.run_id)
    assert mlflow_run.data.params["dataset_size"] == "300"
    assert mlflow_run.data.params["dataset_sha256"] == run.dataset_hash and len(run.dataset_hash) == 64
    metrics = mlflow_run.data.metrics
    assert metrics["candidate_held_out_accuracy"] > metrics["champion_held_out_accuracy"]
    steps = FinetuneConfig().steps
    assert len(registry.client.get_metric_history(version.run_id, "train_loss")) == steps  # each step
    artifacts = {a.path for a in registry.client.list_artifacts(version.run_id, "model")}
    assert artifacts == {"model/model.safetensors", "model/config.json", "model/tokenizer.json"}
    assert count_new(store, MODEL) == 0  # its items are used


def test_a_harmful_dataset_registers_nothing(
    loop_settings: Settings, store: Engine, base_model: CausalLM
) -> None:
    registry = Registry.from_settings(loop_settings)
    operands = arith.sample_operands(300, 0, 49, random.Random(3))  # what the champion gets right
    rate_served_answers(store, base_model, operands, lambda a, b: a + b + 1)  # "corrected" wrongly
    settings = loop_settings.model_copy(update={"finetune_steps": 60})  # enough to do the damage

    outcome = run_finetune(finetune_job_of(settings), store, registry)

    assert outcome.status == "rejected", outcome.message
    assert "regression accuracy fell" in outcome.message
    assert not registry.has_alias(MODEL, CHALLENGER)
    assert [str(v.version) for v in registry.client.search_model_versions(f"name='{MODEL}'")] == ["1"]
    with Session(store) as session:
        (row,) = session.scalars(select(FinetuneRun)).all()
    assert row.status == "rejected" and row.version == "" and row.mlflow_run_id  # logged, not registered
    run = registry.client.get_run(row.mlflow_run_id)
    assert run.data.tags["reflow.verdict"] == outcome.message


def test_lora_on_the_built_in_model_trains_an_adapter_over_its_weights(
    loop_settings: Settings, store: Engine, base_model: CausalLM
) -> None:
    """REFLOW_FINETUNE_METHOD=lora on the demo model (auto still trains it in full): its layers carry
    transformers' names, so an adapter trains over its frozen weights and is logged in PEFT's format."""
    settings = loop_settings.model_copy(update={"finetune_method": "lora", "finetune_steps": 4})
    registry = Registry.from_settings(settings)
    rate_served_answers(store, base_model, arith.sample_operands(40, 50, 99, random.Random(7)), operator.add)

    outcome = run_finetune(finetune_job_of(settings), store, registry, min_samples=1)

    assert outcome.status in ("registered", "rejected"), outcome.message
    shapes = [(128, 128)] * 4 + [(128, 384)] * 2 + [(384, 128)]  # arith-small's q k v o gate up down
    assert (outcome.metrics or {})["trained_parameters"] == 4 * sum(8 * (i + o) for i, o in shapes)
    run = registry.client.search_runs([registry.experiment_id()])[0]  # the newest: this round's
    assert run.data.params["method"] == "lora" and run.data.params["lora_rank"] == "8"
    artifacts = {a.path for a in registry.client.list_artifacts(run.info.run_id, "model")}
    assert {"model/adapter_config.json", "model/adapter_model.safetensors"} <= artifacts
    assert "model/model.safetensors" not in artifacts


def test_too_little_new_feedback_skips_without_a_trace(
    loop_settings: Settings, store: Engine, base_model: CausalLM
) -> None:
    rate_served_answers(store, base_model, arith.sample_operands(10, 50, 99, random.Random(4)), operator.add)
    outcome = run_finetune(finetune_job_of(loop_settings), store, Registry.from_settings(loop_settings))
    assert outcome.status == "skipped" and "10 new labelled feedback item(s)" in outcome.message
    with Session(store) as session:
        assert session.scalars(select(FinetuneRun)).all() == []


def test_an_adapter_champion_is_not_trained_over_and_its_feedback_waits(
    loop_settings: Settings, store: Engine, base_model: CausalLM, tmp_path: Path
) -> None:
    registry = Registry.from_settings(loop_settings)
    registry.register(
        MODEL, save_model(base_model, tmp_path / "second"), params={}, metrics={}, alias="champion",
        tags={BASE_VERSION_TAG: "1"},  # an adapter made champion by hand in the MLflow UI
    )  # fmt: skip
    rate_served_answers(store, base_model, arith.sample_operands(10, 50, 99, random.Random(6)), operator.add)
    outcome = run_finetune(finetune_job_of(loop_settings), store, registry, min_samples=1)
    assert outcome.status == "skipped" and "v2, the champion, is an adapter" in outcome.message
    assert count_new(store, MODEL) == 10


def test_a_cancelled_run_gives_its_items_back(
    loop_settings: Settings, store: Engine, base_model: CausalLM
) -> None:
    rate_served_answers(store, base_model, arith.sample_operands(300, 50, 99, random.Random(5)), operator.add)

    def stop_at_step_3(step: int, _total: int, _loss: float) -> None:
        if step == 3:
            raise Cancelled("the scheduler is stopping")

    outcome = run_finetune(
        finetune_job_of(loop_settings),
        store,
        Registry.from_settings(loop_settings),
        progress=stop_at_step_3,
    )

    assert outcome.status == "failed" and "stopping" in outcome.message
    with Session(store) as session:
        (row,) = session.scalars(select(FinetuneRun)).all()
    assert row.status == "failed" and row.message.startswith("Cancelled")
    assert count_new(store, MODEL) == 300  # the next run takes them all again
