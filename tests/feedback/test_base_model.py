"""The demo base model: trained with the default recipe it meets the task's targets when served."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from feedback.tasks import arith
from feedback.training.bootstrap import evaluate
from feedback.training.pretrain import PretrainConfig
from workers.engine import Engine
from workers.loading import LoadedModel
from workers.models.builtin import Transformer
from workers.models.byte_tokenizer import ByteTokenizer
from workers.sequence import Delta, FinishReason, GenerationParams

pytestmark = pytest.mark.slow
TOK = ByteTokenizer()


@pytest.fixture
def engine(base_model: Transformer) -> Iterator[Engine]:
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


def test_accurate_in_range_and_wrong_often_enough_beyond(base_model: Transformer) -> None:
    metrics = evaluate(base_model, PretrainConfig())
    assert metrics["accuracy_in_range"] >= 0.90
    assert metrics["accuracy_wide_range"] <= 0.60


async def test_served_answers_are_the_evaluated_ones(engine: Engine, base_model: Transformer) -> None:
    prompts = [arith.format_prompt(a, b) for a, b in arith.sample_operands(30, 0, 99, random.Random(5))]
    batched = arith.greedy_answers(base_model, TOK, prompts)
    served = [(await serve(engine, p)).text for p in prompts]
    assert served == batched


async def test_reasoning_streams_then_the_answer(engine: Engine) -> None:
    out = await serve(engine, "47+38=")
    assert out.reasoning_text == arith.reasoning(47, 38)
    assert out.text.strip() == "85"
    assert out.finish_reason is FinishReason.STOP
    assert out.usage is not None and out.usage.reasoning_tokens == len(out.reasoning_text)


async def test_a_spent_reasoning_budget_still_gets_an_answer(engine: Engine) -> None:
    out = await serve(engine, "47+38=", reasoning_budget=2)
    assert out.usage is not None and out.usage.reasoning_tokens == 2
    assert out.reasoning_text == arith.reasoning(47, 38)[:2]
    assert out.text.strip().isdigit() and out.finish_reason is FinishReason.STOP
