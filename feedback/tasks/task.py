"""The `Task` seam: what the learning loop needs to know of a task users ask the models.

A task has two distributions of prompts: the one its base model was trained on (replayed during
fine-tuning against forgetting, and the regression set a candidate must keep) and the one live
users ask (where the base model is wrong often enough to learn from). It knows the right answer
to its own prompts, judges an answer (the oracle of simulated users and of the evaluation sets)
and may give the reasoning a correction is taught with.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from workers.models.prompts import Prompt, user_turn


@dataclass(frozen=True)
class Example:
    """A completion of a prompt (text, or a conversation): an optional thought, then the answer."""

    prompt: Prompt
    thought: str | None
    answer: str


class Task(Protocol):
    """A task the models are asked, with its oracle and its two prompt distributions."""

    @property
    def name(self) -> str:
        """What `reflow simulate --task` calls it."""
        ...

    @property
    def chat(self) -> bool:
        """True: each prompt is sent as the user's message of a one-message conversation and
        rendered with the model's chat template; False: as raw text."""
        ...

    def base_prompts(self, n: int, rng: random.Random) -> list[str]:
        """`n` prompts from the base model's training distribution."""
        ...

    def traffic_prompts(self, n: int, rng: random.Random) -> list[str]:
        """`n` prompts as live users ask them."""
        ...

    def answer(self, prompt: str) -> str | None:
        """The right answer to `prompt`; None when it is not one of this task's prompts (or, for
        a chat task's base prompts, when any good answer will do: replay then uses the champion's)."""
        ...

    def is_correct(self, prompt: str, answer: str) -> bool:
        """The oracle: whether `answer` (the answer text, without the reasoning) is right."""
        ...

    def thought(self, prompt: str) -> str | None:
        """The reasoning a correction of `prompt` is taught with; None to teach the bare answer."""
        ...


def as_prompt(task: Task, text: str) -> Prompt:
    """One of the task's prompts as the model is given it."""
    return user_turn(text) if task.chat else text


def reference_example(task: Task, prompt: str) -> Example:
    """The task's own completion of one of its prompts: its reasoning, then the right answer."""
    answer = task.answer(prompt)
    if answer is None:
        raise ValueError(f"{prompt!r} is not a prompt of the {task.name} task")
    return Example(as_prompt(task, prompt), task.thought(prompt), answer)


def replay_example(task: Task, rng: random.Random) -> Example:
    """A problem of the base model's distribution with its reference completion, replayed while
    fine-tuning so that learning the new does not unlearn the old."""
    [prompt] = task.base_prompts(1, rng)
    return reference_example(task, prompt)
