"""How well a model does a task: greedy accuracy on fixed, seeded sets of its prompts."""

from __future__ import annotations

import random

from feedback.tasks.task import Task, as_prompt
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM, Tokenizer

EVAL_SEED = 1234  # every evaluation set is drawn from a seed derived from this one
BASE_MODEL_PROBLEMS = 500


def accuracy(model: CausalLM, tokenizer: Tokenizer, task: Task, prompts: list[str], **kw: int) -> float:
    """Share of `prompts` whose greedy answer the task's oracle accepts; `kw` goes to `greedy_answers`."""
    answers = greedy_answers(model, tokenizer, [as_prompt(task, p) for p in prompts], **kw)
    return sum(task.is_correct(p, a) for p, a in zip(prompts, answers, strict=True)) / len(prompts)


def base_model_metrics(model: CausalLM, tokenizer: Tokenizer, task: Task) -> dict[str, float]:
    """Greedy accuracy on seeded problems of the base model's range and of live traffic's."""
    in_range = task.base_prompts(BASE_MODEL_PROBLEMS, random.Random(EVAL_SEED))
    wide = task.traffic_prompts(BASE_MODEL_PROBLEMS, random.Random(EVAL_SEED + 1))
    return {
        "accuracy_in_range": accuracy(model, tokenizer, task, in_range),
        "accuracy_wide_range": accuracy(model, tokenizer, task, wide),
    }
