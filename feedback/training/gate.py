"""The gate a candidate passes before it is registered: better on held-out feedback, no worse (within
a tolerance) on a fixed regression set from the base distribution.

Accuracy is exact-answer accuracy under greedy decoding: on held-out items, the answer the user
wanted (their correction, or the completion they rated +1); on the regression set and the
wide-range set (reported, not gated on), the `arith` oracle.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from feedback.tasks import arith
from feedback.training.bootstrap import EVAL_SEED, WIDE_RANGE
from feedback.training.pretrain import PretrainConfig
from workers.models.builtin import Transformer
from workers.models.byte_tokenizer import ByteTokenizer

REGRESSION_PROBLEMS = 300
WIDE_PROBLEMS = 300


@dataclass(frozen=True)
class Verdict:
    """Whether to register, and why, in a sentence."""

    register: bool
    reason: str


def regression_set() -> list[tuple[int, int]]:
    """Fixed problems from the base model's training distribution."""
    base = PretrainConfig()
    return arith.sample_operands(REGRESSION_PROBLEMS, base.lo, base.hi, random.Random(EVAL_SEED + 7))


def wide_set() -> list[tuple[int, int]]:
    """Fixed problems over the wide operand range that live traffic uses."""
    return arith.sample_operands(WIDE_PROBLEMS, *WIDE_RANGE, random.Random(EVAL_SEED + 8))


def evaluate(model: Transformer, held_out: list[tuple[str, str]]) -> dict[str, float]:
    """held_out, regression and wide-range accuracy of `model` (held_out is NaN without items)."""
    tokenizer = ByteTokenizer()
    fits = [(p, a) for p, a in held_out if len(tokenizer.encode(p)) < model.config.max_seq_len - 8]
    answers = arith.greedy_answers(model, tokenizer, [p for p, _ in fits]) if fits else []
    right = sum(answer.strip() == wanted for answer, (_, wanted) in zip(answers, fits, strict=True))
    return {
        "held_out_accuracy": right / len(fits) if fits else float("nan"),
        "regression_accuracy": arith.accuracy(model, tokenizer, regression_set()),
        "wide_range_accuracy": arith.accuracy(model, tokenizer, wide_set()),
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
