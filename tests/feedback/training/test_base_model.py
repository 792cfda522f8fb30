"""The demo base model: trained with the default recipe it meets the task's targets when served."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from feedback.tasks.arith import Arith, reasoning
from feedback.training.evaluation import base_model_metrics, task_score_tags
from reflow.registry import TASK_SCORE_TAG
from tests.support.registry import local_registry
from workers.engine import Engine, EngineConfig
from workers.metrics import WorkerMetrics
from workers.models.builtin import TOKENIZER
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM
from workers.models.loader import save_checkpoint
from workers.residency import ResidentVersion
from workers.sequence import Delta, FinishReason, GenerationParams
from workers.server import WorkerServicer
from workers.versions import Versions

pytestmark = pytest.mark.slow
TOK = TOKENIZER
ARITH = Arith()


@pytest.fixture
def engine(base_model: CausalLM) -> Iterator[Engine]:
    engine = Engine()
    engine.add(ResidentVersion("arith", "1", base_model, TOK, torch.device("cpu"), {"champion"}))
    yield engine
    engine.close()


async def serve(engine: Engine, prompt: str, **params: int) -> Delta:
    out = Delta()
    generation = GenerationParams(max_tokens=params.pop("max_tokens", 48), **params)
    async for delta in engine.generate("arith", "1", TOK.encode(prompt), generation):
        out.merge(delta)
    return out


def test_accurate_in_range_and_wrong_often_enough_beyond(base_model: CausalLM) -> None:
    metrics = base_model_metrics(base_model, TOK, ARITH)
    assert metrics["accuracy_in_range"] >= 0.90
    assert metrics["accuracy_wide_range"] <= 0.60


async def test_served_answers_are_the_evaluated_ones(engine: Engine, base_model: CausalLM) -> None:
    prompts = ARITH.traffic_prompts(30, random.Random(5))
    batched = greedy_answers(base_model, TOK, prompts)
    served = [(await serve(engine, p)).text for p in prompts]
    assert served == batched


async def test_reasoning_streams_then_the_answer(engine: Engine) -> None:
    out = await serve(engine, "47+38=")
    assert out.reasoning_text == reasoning(47, 38)
    assert out.text.strip() == "85"
    assert out.finish_reason is FinishReason.STOP
    assert out.usage is not None and out.usage.reasoning_tokens == len(out.reasoning_text)


async def test_a_spent_reasoning_budget_still_gets_an_answer(engine: Engine) -> None:
    out = await serve(engine, "47+38=", reasoning_budget=2)
    assert out.usage is not None and out.usage.reasoning_tokens == 2
    assert out.reasoning_text == reasoning(47, 38)[:2]
    assert out.text.strip().isdigit() and out.finish_reason is FinishReason.STOP


async def test_variants_are_scored_on_the_task_and_their_workers_report_it(
    base_model: CausalLM, tmp_path: Path
) -> None:
    tags = task_score_tags(base_model, TOK, ARITH, ("int8",))
    own, int8 = float(tags[TASK_SCORE_TAG]), float(tags[f"{TASK_SCORE_TAG}.int8"])
    assert own > 0.2 and 0.0 <= int8 <= 1.0  # real accuracies of the live-traffic set
    registry = local_registry(tmp_path)
    registry.register("arith", save_checkpoint(base_model, TOK, tmp_path / "v1"), params={}, metrics={},
                      alias="champion", tags=tags)  # fmt: skip
    engine = Engine(EngineConfig(kv_cache_mb=4), WorkerMetrics())
    try:
        cpu = torch.device("cpu")
        versions = Versions(engine, registry, tmp_path / "cache", cpu, None, variants=("int8",))
        await versions.load("arith", alias="champion")
        (loaded,) = WorkerServicer(versions).status().loaded
        scores = {v.name: v.task_score for v in loaded.variants}
        assert scores == pytest.approx({"float32": own, "int8": int8}, abs=1e-4)
        assert engine.metrics is not None
        labels = {"model": "arith", "version": "1", "variant": "int8"}
        gauge = engine.metrics.registry.get_sample_value("reflow_worker_variant_task_score", labels)
        assert gauge == pytest.approx(int8, abs=1e-4)
    finally:
        engine.close()
