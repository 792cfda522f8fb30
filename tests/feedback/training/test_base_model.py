"""The demo base model: trained with the default recipe it meets the task's targets when served."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from feedback.tasks.arith import Arith, reasoning
from feedback.training.evaluation import base_model_metrics
from workers.engine import Engine
from workers.loading import LoadedModel
from workers.models.builtin import TOKENIZER
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM
from workers.sequence import Delta, FinishReason, GenerationParams

pytestmark = pytest.mark.slow
TOK = TOKENIZER
ARITH = Arith()


@pytest.fixture
def engine(base_model: CausalLM) -> Iterator[Engine]:
    engine = Engine()
    engine.add(LoadedModel("arith", "1", base_model, TOK, torch.device("cpu"), {"champion"}))
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
