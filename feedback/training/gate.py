"""The gate a candidate passes before it is registered: better on held-out feedback, no worse (within
a tolerance) on a fixed regression set from the task's base distribution, and, for chat tasks, not
moved far from the champion on a fixed set of general chat prompts.

Accuracy is exact-answer accuracy under greedy decoding: on held-out items, the answer the user
wanted (their correction, or the completion they rated +1); on the regression set and on a set of
live traffic's prompts (reported, not gated on), the task's oracle. A chat task's base prompts have
no one right answer, so there the regression set is `REGRESSION_PROMPTS`: the champion answers each
greedily, and the candidate's mean per-token KL to the champion over those answers, and how much
less likely it finds them (mean negative log-likelihood per token), must stay within limits.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from feedback.tasks.task import Example, Task
from feedback.training.evaluation import EVAL_SEED, accuracy
from feedback.training.examples import example_rows, pad_rows
from feedback.training.regression_prompts import REGRESSION_PROMPTS
from workers.models.greedy import greedy_answers
from workers.models.interface import CausalLM, Tokenizer
from workers.models.prompts import Prompt, prompt_ids, user_turn

REGRESSION_PROBLEMS = 300
WIDE_PROBLEMS = 300
ANSWER_ROOM = 8  # tokens of context a held-out prompt must leave for its answer
REGRESSION_ANSWER_TOKENS = 64  # of the champion's answer to each general chat prompt
SHIFT_ROWS = 8  # answers teacher-forced at once


@dataclass(frozen=True)
class Limits:
    """How far a candidate may fall behind the champion and still be registered."""

    accuracy_drop: float = 0.02  # regression-set accuracy (tasks whose base prompts have answers)
    kl: float = 0.5  # mean per-token KL(candidate || champion) on the general chat prompts, nats
    nll_increase: float = 0.1  # mean per-token NLL of the champion's answers there, nats


@dataclass(frozen=True)
class Verdict:
    """Whether to register, and why, in a sentence."""

    register: bool
    reason: str


def measure(
    model: CausalLM, tokenizer: Tokenizer, task: Task, held_out: list[tuple[Prompt, str]]
) -> dict[str, float]:
    """held_out, regression and wide-range accuracy of `model` (held_out is NaN without items)."""
    room = model.max_seq_len - ANSWER_ROOM
    fits = [(p, a) for p, a in held_out if len(prompt_ids(tokenizer, p)) < room]
    answers = greedy_answers(model, tokenizer, [p for p, _ in fits]) if fits else []
    right = sum(answer.strip() == wanted for answer, (_, wanted) in zip(answers, fits, strict=True))
    wide = task.traffic_prompts(WIDE_PROBLEMS, random.Random(EVAL_SEED + 8))
    metrics = {
        "held_out_accuracy": right / len(fits) if fits else float("nan"),
        "wide_range_accuracy": accuracy(model, tokenizer, task, wide),
        "held_out_items": float(len(fits)),
    }
    if not task.chat:  # a chat task's base prompts have no one right answer to score
        regression = task.base_prompts(REGRESSION_PROBLEMS, random.Random(EVAL_SEED + 7))
        metrics["regression_accuracy"] = accuracy(model, tokenizer, task, regression)
    return metrics


def champion_answers(champion: CausalLM, tokenizer: Tokenizer) -> list[Example]:
    """The champion's greedy answers to the general chat prompts: what a candidate is held to."""
    prompts = [user_turn(p) for p in REGRESSION_PROMPTS]
    answers = greedy_answers(champion, tokenizer, prompts, max_new_tokens=REGRESSION_ANSWER_TOKENS)
    return [Example(p, None, a) for p, a in zip(prompts, answers, strict=True)]


@torch.inference_mode()
def regression_shift(
    champion: CausalLM, candidate: CausalLM, tokenizer: Tokenizer, answers: list[Example]
) -> dict[str, float]:
    """Over the champion's own `answers` (teacher-forced): the candidate's mean per-token
    KL(candidate || champion), and the mean negative log-likelihood per token of each model."""
    kl = nll = reference_nll = count = 0.0
    for start in range(0, len(answers), SHIFT_ROWS):  # [rows, T, V] logits: a few hundred MB each
        rows = example_rows(tokenizer, answers[start : start + SHIFT_ROWS])
        tokens, mask = pad_rows(rows, tokenizer.pad_id)
        tokens, weights = tokens.to(champion.device), mask[:, 1:].to(champion.device).float()  # [B, T-1]
        reference = champion(tokens[:, :-1]).float().log_softmax(-1)  # [B, T-1, V]
        logps = candidate(tokens[:, :-1]).float().log_softmax(-1)
        targets = tokens[:, 1:, None]
        kl += float(((logps.exp() * (logps - reference)).sum(-1) * weights).sum())
        nll -= float((logps.gather(-1, targets)[..., 0] * weights).sum())
        reference_nll -= float((reference.gather(-1, targets)[..., 0] * weights).sum())
        count += float(weights.sum())
    count = max(count, 1.0)
    return {
        "regression_kl": kl / count,
        "regression_nll": nll / count,
        "regression_nll_champion": reference_nll / count,
    }


def judge(champion: dict[str, float], candidate: dict[str, float], limits: Limits) -> Verdict:
    """Register only a candidate that improves on held-out and keeps the regression set."""
    if not champion["held_out_items"]:
        return Verdict(False, "no held-out feedback with a known answer to show an improvement on")
    if "regression_kl" in candidate:
        kl = candidate["regression_kl"]
        nll_increase = candidate["regression_nll"] - candidate["regression_nll_champion"]
        if not math.isfinite(kl) or kl > limits.kl:
            return Verdict(
                False,
                f"on the general chat prompts the candidate moved {kl:.3f} nats/token (KL) from the "
                f"champion, more than the {limits.kl:.3f} allowed",
            )
        if nll_increase > limits.nll_increase:
            return Verdict(
                False,
                f"on the general chat prompts the champion's own answers became {nll_increase:.3f} "
                f"nats/token less likely, more than the {limits.nll_increase:.3f} allowed",
            )
    if "regression_accuracy" not in champion:
        return _held_out_verdict(champion, candidate, "")
    drop = champion["regression_accuracy"] - candidate["regression_accuracy"]
    tolerance = limits.accuracy_drop
    if drop > tolerance + 1e-9:  # a drop of exactly the tolerance is tolerated
        return Verdict(
            False,
            f"regression accuracy fell {drop:.1%} ({champion['regression_accuracy']:.1%} -> "
            f"{candidate['regression_accuracy']:.1%}), more than the {tolerance:.1%} tolerated",
        )
    kept = f"regression {champion['regression_accuracy']:.1%} -> {candidate['regression_accuracy']:.1%}"
    return _held_out_verdict(champion, candidate, kept)


def _held_out_verdict(champion: dict[str, float], candidate: dict[str, float], kept: str) -> Verdict:
    if candidate["held_out_accuracy"] <= champion["held_out_accuracy"]:
        return Verdict(
            False,
            f"held-out accuracy did not improve ({champion['held_out_accuracy']:.1%} -> "
            f"{candidate['held_out_accuracy']:.1%})",
        )
    if "regression_kl" in candidate:
        kept = f"KL to the champion on general chat {candidate['regression_kl']:.3f} nats/token"
    gain = f"held-out accuracy {champion['held_out_accuracy']:.1%} -> {candidate['held_out_accuracy']:.1%}"
    return Verdict(True, f"{gain}, {kept}")
