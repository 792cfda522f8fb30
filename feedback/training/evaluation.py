"""How well a model does a task: greedy accuracy on fixed, seeded sets of its prompts."""

from __future__ import annotations

import random

from feedback.tasks.task import Task, as_prompt
from reflow.registry import TASK_SCORE_TAG
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM, Tokenizer
from workers.models.precision import in_precision

EVAL_SEED = 1234  # every evaluation set is drawn from a seed derived from this one
BASE_MODEL_PROBLEMS = 500
TASK_SCORE_PROBLEMS = 200


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


def task_score_tags(
    model: CausalLM, tokenizer: Tokenizer, task: Task, variants: tuple[str, ...]
) -> dict[str, str]:
    """A version's task-score tags (TASK_SCORE_TAG): its greedy accuracy on a fixed set of live
    traffic's prompts, and each of `variants`' (REFLOW_VARIANTS), built as a worker builds it (the
    same weights give the same variant, so the score is the one it would measure when it loads).
    int8 exists on the CPU only: not scored for a model elsewhere, as no worker there builds it."""
    prompts = task.traffic_prompts(TASK_SCORE_PROBLEMS, random.Random(EVAL_SEED + 9))
    tags = {TASK_SCORE_TAG: f"{accuracy(model, tokenizer, task, prompts):.4f}"}
    on_cpu = next(model.parameters()).device.type == "cpu"
    for name in variants:
        if name != "int8" or on_cpu:
            score = accuracy(in_precision(model, name), tokenizer, task, prompts)
            tags[f"{TASK_SCORE_TAG}.{name}"] = f"{score:.4f}"
    return tags
