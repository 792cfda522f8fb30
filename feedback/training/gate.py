"""The gate a candidate passes before it is registered: better on held-out feedback, no worse (within
a tolerance) on a fixed regression set from the task's base distribution.

Accuracy is exact-answer accuracy under greedy decoding: on held-out items, the answer the user
wanted (their correction, or the completion they rated +1); on the regression set and on a set of
live traffic's prompts (reported, not gated on), the task's oracle.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from feedback.tasks.task import Task
from feedback.training.evaluation import EVAL_SEED, accuracy
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM, Tokenizer

REGRESSION_PROBLEMS = 300
WIDE_PROBLEMS = 300
ANSWER_ROOM = 8  # tokens of context a held-out prompt must leave for its answer


@dataclass(frozen=True)
class Verdict:
    """Whether to register, and why, in a sentence."""

    register: bool
    reason: str


def measure(
    model: CausalLM, tokenizer: Tokenizer, task: Task, held_out: list[tuple[str, str]]
) -> dict[str, float]:
    """held_out, regression and wide-range accuracy of `model` (held_out is NaN without items)."""
    fits = [(p, a) for p, a in held_out if len(tokenizer.encode(p)) < model.max_seq_len - ANSWER_ROOM]
    answers = greedy_answers(model, tokenizer, [p for p, _ in fits]) if fits else []
    right = sum(answer.strip() == wanted for answer, (_, wanted) in zip(answers, fits, strict=True))
    regression = task.base_prompts(REGRESSION_PROBLEMS, random.Random(EVAL_SEED + 7))
    wide = task.traffic_prompts(WIDE_PROBLEMS, random.Random(EVAL_SEED + 8))
    return {
        "held_out_accuracy": right / len(fits) if fits else float("nan"),
        "regression_accuracy": accuracy(model, tokenizer, task, regression),
        "wide_range_accuracy": accuracy(model, tokenizer, task, wide),
        "held_out_items": float(len(fits)),
    }


def judge(champion: dict[str, float], candidate: dict[str, float], tolerance: float) -> Verdict:
    """Register only a candidate that improves on held-out and keeps the regression set."""
    if not champion["held_out_items"]:
        return Verdict(False, "no held-out feedback with a known answer to show an improvement on")
    drop = champion["regression_accuracy"] - candidate["regression_accuracy"]
    if drop > tolerance + 1e-9:  # a drop of exactly the tolerance is tolerated
        return Verdict(
            False,
            f"regression accuracy fell {drop:.1%} ({champion['regression_accuracy']:.1%} -> "
            f"{candidate['regression_accuracy']:.1%}), more than the {tolerance:.1%} tolerated",
        )
    if candidate["held_out_accuracy"] <= champion["held_out_accuracy"]:
        return Verdict(
            False,
            f"held-out accuracy did not improve ({champion['held_out_accuracy']:.1%} -> "
            f"{candidate['held_out_accuracy']:.1%})",
        )
    return Verdict(
        True,
        f"held-out accuracy {champion['held_out_accuracy']:.1%} -> {candidate['held_out_accuracy']:.1%}, "
        f"regression {champion['regression_accuracy']:.1%} -> {candidate['regression_accuracy']:.1%}",
    )
