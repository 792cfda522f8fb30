"""The `arith` task: its prompts, canonical reasoning, the oracle and its two distributions."""

from __future__ import annotations

import random

import pytest

from feedback.tasks import TASKS, get_task
from feedback.tasks.arith import Arith, format_prompt, is_correct, parse_prompt, reasoning, sample_operands
from feedback.tasks.task import reference_example, replay_example
from reflow.settings import Settings


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


def test_the_task_seam_answers_its_own_prompts_and_draws_from_its_two_ranges() -> None:
    task = Arith()
    base = [parse_prompt(p) for p in task.base_prompts(400, random.Random(0))]
    traffic = [parse_prompt(p) for p in task.traffic_prompts(400, random.Random(0))]
    assert max(max(pair) for pair in base if pair) <= 49 < max(max(pair) for pair in traffic if pair)
    assert task.answer("47+38=") == "85" and task.answer("hello") is None
    assert task.thought("47+38=") == reasoning(47, 38) and task.thought("hello") is None
    assert reference_example(task, "5+38=").answer == "43"
    example = replay_example(task, random.Random(1))
    assert max(parse_prompt(example.prompt) or (99,)) <= 49 and task.is_correct(
        example.prompt, example.answer
    )
    with pytest.raises(ValueError, match="not a prompt of the arith task"):
        reference_example(task, "hello")


def test_tasks_are_found_by_the_names_settings_allow() -> None:
    assert isinstance(get_task("arith", traffic=(0, 9)), Arith)
    with pytest.raises(ValueError, match="unknown task 'chess'; reflow has arith, numbered, terse"):
        get_task("chess")
    task_field = Settings.model_fields["task"].annotation
    assert set(getattr(task_field, "__args__", ())) == {
        "",
        *TASKS,
    }  # REFLOW_TASK: the tasks there are, or none
