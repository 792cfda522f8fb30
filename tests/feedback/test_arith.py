"""Unit tests for the `arith` task and the base-model trainer (tiny model, CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from feedback.tasks.arith import Arith, format_prompt, is_correct, parse_prompt, reasoning, sample_operands
from feedback.training.evaluation import accuracy
from feedback.training.examples import training_example
from feedback.training.pretrain import PretrainConfig, train_base_model
from tests.conftest import reference_greedy
from tests.conftest import tiny_model as new_tiny_model
from workers.models.builtin import TOKENIZER
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM


@pytest.fixture
def tiny_model() -> CausalLM:
    return new_tiny_model(3)


@pytest.mark.parametrize(("a", "b"), [(0, 0), (7, 38), (47, 38), (99, 1), (123, 4567)])
def test_prompt_round_trip(a: int, b: int) -> None:
    assert parse_prompt(format_prompt(a, b)) == (a, b)


@pytest.mark.parametrize(
    "prompt",
    ["", "1+2", "1+2=3", "07+3=", " 1+2=", "1+2= ", "1-2=", "-1+2=", "1++2=", "a+b=", "\u0661+\u0662=", "hi"],
)
def test_parse_rejects_non_arith_prompts(prompt: str) -> None:
    assert parse_prompt(prompt) is None


def test_format_rejects_negative_operands() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        format_prompt(-1, 2)


@pytest.mark.parametrize(
    ("prompt", "answer", "expected"),
    [
        ("47+38=", "85", True),
        ("47+38=", " 85\n", True),
        ("0+0=", "0", True),
        ("99+1=", "100", True),
        ("47+38=", "86", False),
        ("47+38=", "085", False),
        ("47+38=", "8 5", False),
        ("47+38=", "", False),
        ("47+38", "85", False),
        ("hello", "85", False),
    ],
)
def test_oracle(prompt: str, answer: str, expected: bool) -> None:
    assert is_correct(prompt, answer) is expected


@pytest.mark.parametrize(
    ("a", "b", "thought"),
    [
        (0, 0, "0+0=0"),
        (12, 30, "2+0=2, 1+3=4"),
        (47, 38, "7+8=15, 4+3+1=8"),
        (5, 38, "5+8=13, 0+3+1=4"),
        (38, 5, "8+5=13, 3+0+1=4"),
        (99, 1, "9+1=10, 9+0+1=10"),
        (95, 5, "5+5=10, 9+0+1=10"),
    ],
)
def test_reasoning_with_carries(a: int, b: int, thought: str) -> None:
    assert reasoning(a, b) == thought


def test_reasoning_spells_out_the_answer() -> None:
    # The answer is the last column sum, then the ones digits of the earlier ones, last first.
    for a in range(0, 120, 7):
        for b in range(0, 120, 3):
            sums = [step.split("=")[1] for step in reasoning(a, b).split(", ")]
            assert sums[-1] + "".join(s[-1] for s in reversed(sums[:-1])) == str(a + b)


def test_sample_operands_is_seeded_and_in_range() -> None:
    pairs = sample_operands(500, 3, 9, random.Random(0))
    assert pairs == sample_operands(500, 3, 9, random.Random(0))
    assert {x for pair in pairs for x in pair} == set(range(3, 10))
    with pytest.raises(ValueError):
        sample_operands(1, 5, 4, random.Random(0))


def test_training_example_masks_exactly_the_completion() -> None:
    ids, mask = training_example(TOKENIZER, "47+38=", "85", "7+8=15, 4+3+1=8")
    prompt = [TOKENIZER.bos_id, *b"47+38="]
    completion = [TOKENIZER.think_id, *b"7+8=15, 4+3+1=8", TOKENIZER.end_think_id, *b"85"]
    assert ids == prompt + completion + [TOKENIZER.eos_id]
    assert mask == [0] * len(prompt) + [1] * (len(completion) + 1)


def test_training_example_without_thought_has_no_think_tags() -> None:
    ids, mask = training_example(TOKENIZER, "1+2=", "3", None)
    assert ids == [TOKENIZER.bos_id, *b"1+2=", *b"3", TOKENIZER.eos_id]
    assert mask == [0, 0, 0, 0, 0, 1, 1]


PROMPTS = ["1+2=", "47+38=", "0+0=", "123+4567=", "9+10=", "5+5="]


def test_greedy_answers_batched_matches_one_at_a_time(tiny_model: CausalLM) -> None:
    batched = greedy_answers(tiny_model, TOKENIZER, PROMPTS, max_new_tokens=20, batch_size=4)
    single = [greedy_answers(tiny_model, TOKENIZER, [p], max_new_tokens=20)[0] for p in PROMPTS]
    assert len(batched) == len(PROMPTS)
    assert batched == single
    assert any(batched)  # the random model does emit text, so the comparison means something


def test_greedy_answers_match_uncached_decoding(tiny_model: CausalLM) -> None:
    answers = greedy_answers(tiny_model, TOKENIZER, PROMPTS, max_new_tokens=20)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        generated = reference_greedy(tiny_model, prompt, max_new_tokens=20)
        assert TOKENIZER.think_id not in generated  # so the whole continuation is the answer
        assert answer == TOKENIZER.decode([t for t in generated if t != TOKENIZER.eos_id])


def test_greedy_answers_stop_at_max_seq_len(tiny_model: CausalLM) -> None:
    answers = greedy_answers(tiny_model, TOKENIZER, PROMPTS, max_new_tokens=1000)
    assert len(answers) == len(PROMPTS)


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
