"""The base model's trainer, and accuracy on a task's prompts, on the tiny preset."""

from __future__ import annotations

import pytest
import torch

from feedback.tasks.arith import Arith
from feedback.training.evaluation import accuracy
from feedback.training.pretrain import PretrainConfig, train_base_model
from tests.support.models import tiny_model as new_tiny_model
from workers.models.builtin import TOKENIZER
from workers.models.interface import CausalLM


@pytest.fixture
def tiny_model() -> CausalLM:
    return new_tiny_model(3)


def test_accuracy_of_untrained_model_is_a_share(tiny_model: CausalLM) -> None:
    assert accuracy(tiny_model, TOKENIZER, Arith(), ["1+2=", "3+4="], max_new_tokens=8) == 0.0


def _tiny_run(seed: int, steps: int) -> tuple[CausalLM, list[tuple[int, int, float]]]:
    config = PretrainConfig(preset="tiny", steps=steps, batch_size=16, lr=1e-2, warmup_steps=5, seed=seed)
    calls: list[tuple[int, int, float]] = []
    model, _ = train_base_model(config, Arith(), progress=lambda *call: calls.append(call))
    return model, calls


def test_train_base_model_lowers_the_loss_and_reports_progress() -> None:
    model, calls = _tiny_run(seed=0, steps=40)
    assert [(step, total) for step, total, _ in calls] == [(s, 40) for s in range(1, 41)]
    losses = [loss for _, _, loss in calls]
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]
    assert not model.training


def test_train_base_model_is_deterministic_for_a_seed() -> None:
    first, _ = _tiny_run(seed=7, steps=8)
    second, _ = _tiny_run(seed=7, steps=8)
    other, _ = _tiny_run(seed=8, steps=8)
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not all(torch.equal(a[name], c[name]) for name in a)
