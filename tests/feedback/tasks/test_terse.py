"""The `terse` chat task: its prompts, answers, oracle and two distributions, without a model."""

from __future__ import annotations

import random

import pytest

from feedback.tasks import get_task
from feedback.tasks.arith import format_prompt
from feedback.tasks.task import reference_example
from feedback.tasks.terse import ATTRIBUTES, BASE_PROMPTS, WRAPPERS, Terse, is_correct, parse_prompt
from feedback.training.general_prompts import REGRESSION_PROMPTS, REPLAY_PROMPTS

LISBON = "Rosa lives in Lisbon. Where does Rosa live?"
AGE = "Here is a fact: Dan turned 38 this spring. What is Dan's age?"
JOB = "Finn is a singer by profession. What is Finn's job? Answer in one word."


def test_registered_as_a_chat_task() -> None:
    task = get_task("terse")
    assert isinstance(task, Terse)
    assert task.name == "terse"
    assert task.chat is True


def test_traffic_prompts_are_deterministic_per_seed() -> None:
    task = Terse()
    assert task.traffic_prompts(50, random.Random(3)) == task.traffic_prompts(50, random.Random(3))
    assert task.traffic_prompts(50, random.Random(3)) != task.traffic_prompts(50, random.Random(4))


def test_traffic_prompts_are_varied() -> None:
    prompts = Terse().traffic_prompts(600, random.Random(0))
    assert len(set(prompts)) > 590
    answers = {parse_prompt(p) for p in prompts}
    assert len(answers) > 100
    # Every framing and every kind of fact turns up.
    assert all(any(wrapper.split("{")[0] in p for p in prompts) for wrapper in WRAPPERS)
    for attribute in ATTRIBUTES:
        assert any(parse_prompt(p) in attribute.values for p in prompts)


def test_every_traffic_prompt_has_its_answer_in_it() -> None:
    task = Terse()
    for prompt in task.traffic_prompts(500, random.Random(1)):
        answer = task.answer(prompt)
        assert answer is not None and answer in prompt
        assert task.is_correct(prompt, answer)
        assert task.thought(prompt) is None


@pytest.mark.parametrize(
    ("prompt", "answer"),
    [(LISBON, "Lisbon"), (AGE, "38"), (JOB, "singer"), ("What is Ian's age? (Ian is 49 years old.)", "49")],
)
def test_answer(prompt: str, answer: str) -> None:
    assert Terse().answer(prompt) == answer


@pytest.mark.parametrize(
    ("prompt", "text", "expected"),
    [
        (LISBON, "Lisbon", True),
        (LISBON, " Lisbon\n", True),
        (LISBON, "Lisbon.", True),
        (LISBON, "lisbon", True),
        (LISBON, "LISBON.\n", True),
        (AGE, "38", True),
        (AGE, "38.", True),
        (JOB, "singer", True),
        (JOB, "A singer.", True),
        (LISBON, "Rosa lives in Lisbon.", False),
        (LISBON, "The answer is Lisbon.", False),
        (LISBON, "Lisbon, Portugal", False),
        (LISBON, "Lisbon..", False),
        (LISBON, "**Lisbon**", False),
        (LISBON, '"Lisbon"', False),
        (LISBON, "Madrid", False),
        (LISBON, "", False),
        (AGE, "Dan is 38 years old.", False),
        (AGE, "thirty-eight", False),
        (AGE, "038", False),
        (AGE, "39", False),
        (JOB, "musician", False),
        ("Where does Rosa live?", "Lisbon", False),
        ("hello", "Lisbon", False),
    ],
)
def test_oracle(prompt: str, text: str, expected: bool) -> None:
    assert is_correct(prompt, text) is expected
    assert Terse().is_correct(prompt, text) is expected


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        "hello",
        "Where does Rosa live?",
        format_prompt(47, 38),
        LISBON + " ",
        " " + LISBON,
        "Rosa lives in Lisbon. Where does Maya live?",  # asks about someone the fact does not mention
        "Bob lives in Lisbon. Where does Bob live?",  # not one of the task's names
        "Rosa lives in Springfield. Where does Rosa live?",  # not one of its cities
        "Rosa lives in Lisbon. What is Rosa's favourite colour?",  # a question the fact does not answer
        "Rosa has 7 dragons. How many dragons does Rosa have?",  # not one of its things
        "Rosa has 7 cats. How many hats does Rosa have?",
    ],
)
def test_answer_is_none_for_other_prompts(prompt: str) -> None:
    assert Terse().answer(prompt) is None
    assert not Terse().is_correct(prompt, "Lisbon")


def test_base_prompts_are_general_chat() -> None:
    task = Terse()
    prompts = task.base_prompts(200, random.Random(5))
    assert prompts == task.base_prompts(200, random.Random(5))
    assert set(prompts) <= set(BASE_PROMPTS)
    assert len(set(BASE_PROMPTS)) == len(BASE_PROMPTS) >= 64
    assert all(task.answer(p) is None for p in BASE_PROMPTS)  # replay answers them with the champion's


def test_the_general_prompts_are_two_disjoint_sets_of_everyday_chat() -> None:
    assert len(REGRESSION_PROMPTS) == len(set(REGRESSION_PROMPTS)) == 32
    assert len(REPLAY_PROMPTS) == len(set(REPLAY_PROMPTS)) == 40
    assert not set(REGRESSION_PROMPTS) & set(REPLAY_PROMPTS)  # never judged on what it was held to
    assert not set(REGRESSION_PROMPTS) & set(BASE_PROMPTS)
    assert all(Terse().answer(p) is None for p in REGRESSION_PROMPTS + REPLAY_PROMPTS)


def test_reference_example_is_the_bare_answer_to_a_user_turn() -> None:
    example = reference_example(Terse(), LISBON)
    assert example.answer == "Lisbon"
    assert example.thought is None
    assert example.prompt == (("user", LISBON),)
