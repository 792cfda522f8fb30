"""The gate a candidate passes before it is registered, with no answer key: better on held-out
feedback, and not moved far from the champion elsewhere.

On held-out feedback (users the candidate did not learn from, `dataset.py`), each completion's
implicit reward is the candidate's log-likelihood ratio to the champion, over the answer users saw
and judged (a thought before it is context). The candidate must rank
the completions users wanted (corrections, +1, preferred) above those they did not (-1, passed
over) better than chance by a margin (the AUC of the reward, at one-sided 95% confidence), and make
the typical wanted one more likely, and the typical unwanted one less likely than that (the median
per-token gain of each side: with a share of ratings the wrong way round, the few flipped items
would decide a mean). Not "unwanted less likely" outright: an adapter that learned what SmolLM2's
users like also made its own answers a little surer on the whole (wanted +0.165, unwanted +0.001
nats/token, AUC 0.82), and was right to. Elsewhere, it must not
drift: over the champion's own greedy answers to a fixed set of general prompts (rendered as chat
when the model has a chat template), its mean per-token KL to the champion and how much less
likely it finds those answers must stay within limits. Where a demo task has an oracle for its
base prompts, the regression check is instead that task's accuracy, and greedy exact-answer
accuracy on held-out items must improve too; both are the task's, never needed in production.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

import torch

from feedback.tasks.task import Example, Task
from feedback.training.dataset import Judged
from feedback.training.evaluation import EVAL_SEED, accuracy
from feedback.training.examples import example_rows, pad_rows
from feedback.training.losses import completion_logits, sequence_logps
from workers.models.greedy import completions, greedy_answers
from workers.models.interface import CausalLM, Tokenizer
from workers.models.prompts import Prompt, prompt_ids, user_turn

REGRESSION_PROBLEMS = 300
WIDE_PROBLEMS = 300
ANSWER_ROOM = 8  # tokens of context a held-out prompt must leave for its answer
REGRESSION_ANSWER_TOKENS = 64  # of the champion's answer to each general prompt
SHIFT_ROWS = 8  # answers teacher-forced at once
Z_95 = 1.645  # one-sided 95% normal quantile: the AUC's lower confidence bound


@dataclass(frozen=True)
class Limits:
    """What a candidate must show on held-out feedback, and how far it may drift elsewhere."""

    accuracy_drop: float = 0.02  # regression-set accuracy (a demo task whose base prompts have answers)
    kl: float = 0.5  # mean per-token KL(candidate || champion) on the general prompts, nats
    nll_increase: float = 0.1  # mean per-token NLL of the champion's answers there, nats
    reward_margin: float = 0.05  # the reward AUC's 95% lower bound must exceed 0.5 by this much
    min_held_out: int = 5  # held-out wanted and unwanted completions each, to rank them at all


@dataclass(frozen=True)
class Verdict:
    """Whether to register, and why, in a sentence."""

    register: bool
    reason: str


def has_chat_template(tokenizer: Tokenizer) -> bool:
    """Whether the model renders conversations (a chat model) or takes only text."""
    try:
        tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    except ValueError:
        return False
    return True


@torch.inference_mode()
def _answer_logps(
    model: CausalLM, tokenizer: Tokenizer, examples: list[Example]
) -> tuple[list[float], list[int]]:
    """Each example's answer log-likelihood under `model` (teacher-forced, after its thought), and
    the answer's tokens."""
    logps: list[float] = []
    counts: list[int] = []
    for start in range(0, len(examples), SHIFT_ROWS):
        rows = example_rows(tokenizer, examples[start : start + SHIFT_ROWS], answers_only=True)
        tokens, mask = pad_rows(rows, tokenizer.pad_id)
        tokens, mask = tokens.to(model.device), mask.to(model.device)
        logps += sequence_logps(model, tokens, mask).float().tolist()
        counts += mask[:, 1:].sum(-1).tolist()
    return logps, counts


def reward_auc(wanted: list[float], unwanted: list[float]) -> tuple[float, float]:
    """The chance a wanted completion's reward is above an unwanted one's (ties count half), and its
    standard error (Hanley and McNeil, 1982)."""
    n1, n2 = len(wanted), len(unwanted)
    above = sum((w > u) + 0.5 * (w == u) for w in wanted for u in unwanted)
    auc = above / (n1 * n2)
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    variance = (auc * (1 - auc) + (n1 - 1) * (q1 - auc * auc) + (n2 - 1) * (q2 - auc * auc)) / (n1 * n2)
    return auc, math.sqrt(max(variance, 0.0))


def feedback_shift(
    champion: CausalLM, candidate: CausalLM, tokenizer: Tokenizer, held_out: list[Judged]
) -> dict[str, float]:
    """How the candidate moved on held-out feedback: the AUC of its implicit reward (wanted over
    unwanted) with its lower bound, and each side's median per-token log-likelihood gain (the
    median, as a share of the labels may be the wrong way round: one flipped item can move a mean
    by more than the rest)."""
    room = champion.max_seq_len
    rows = example_rows(tokenizer, [j.example for j in held_out])
    fits = [j for j, (ids, _) in zip(held_out, rows, strict=True) if len(ids) <= room]
    examples = [j.example for j in fits]
    before, counts = _answer_logps(champion, tokenizer, examples)
    after, _ = _answer_logps(candidate, tokenizer, examples)
    rewards: dict[bool, list[float]] = {True: [], False: []}  # by wanted
    gains: dict[bool, list[float]] = {True: [], False: []}  # per token
    for judged, a, b, n in zip(fits, after, before, counts, strict=True):
        rewards[judged.wanted].append(a - b)
        gains[judged.wanted].append((a - b) / max(n, 1))
    metrics: dict[str, float] = {}
    for side, wanted in (("wanted", True), ("unwanted", False)):
        metrics[f"held_out_{side}"] = float(len(gains[wanted]))
        metrics[f"{side}_logp_gain"] = statistics.median(gains[wanted]) if gains[wanted] else float("nan")
    auc, error = reward_auc(rewards[True], rewards[False]) if rewards[True] and rewards[False] else (
        float("nan"), float("nan")
    )  # fmt: skip
    return metrics | {"reward_auc": auc, "reward_auc_lower": auc - Z_95 * error}


def oracle_metrics(
    model: CausalLM, tokenizer: Tokenizer, task: Task, held_out: list[tuple[Prompt, str]]
) -> dict[str, float]:
    """A demo task's oracle metrics of `model`: greedy exact-answer accuracy on held-out items (NaN
    without items), wide-range accuracy, and regression accuracy where its base prompts have answers."""
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
    if has_base_answers(task):
        regression = task.base_prompts(REGRESSION_PROBLEMS, random.Random(EVAL_SEED + 7))
        metrics["regression_accuracy"] = accuracy(model, tokenizer, task, regression)
    return metrics


def has_base_answers(task: Task) -> bool:
    """Whether the task knows the answer to its base prompts (arith), so that regression is its accuracy."""
    return task.answer(task.base_prompts(1, random.Random(0))[0]) is not None


def champion_answers(champion: CausalLM, tokenizer: Tokenizer, general: tuple[str, ...]) -> list[Example]:
    """The champion's greedy completions of the `general` prompts: what a run replays, and what a
    candidate is held to (thought included, where the model thinks)."""
    chat = has_chat_template(tokenizer)  # a user turn for a chat model, else the text
    prompts: list[Prompt] = [user_turn(p) if chat else p for p in general]
    found = completions(champion, tokenizer, prompts, max_new_tokens=REGRESSION_ANSWER_TOKENS)
    return [Example(p, thought, answer) for p, (thought, answer) in zip(prompts, found, strict=True)]


@torch.inference_mode()
def regression_shift(
    champion: CausalLM, candidate: CausalLM, tokenizer: Tokenizer, answers: list[Example]
) -> dict[str, float]:
    """Over the champion's own `answers` (teacher-forced): the candidate's mean per-token
    KL(candidate || champion), and the mean negative log-likelihood per token of each model."""
    kl = nll = reference_nll = count = 0.0
    for start in range(0, len(answers), SHIFT_ROWS):  # [answers' tokens, V] logits: tens of MB each
        rows = example_rows(tokenizer, answers[start : start + SHIFT_ROWS])
        tokens, mask = pad_rows(rows, tokenizer.pad_id)
        tokens, mask = tokens.to(champion.device), mask.to(champion.device)
        found = completion_logits(champion, tokens, mask)  # [N, V]: the answers' tokens
        reference = found.logits.float().log_softmax(-1)
        logps = completion_logits(candidate, tokens, mask).logits.float().log_softmax(-1)
        targets = found.targets[:, None]
        kl += float((logps.exp() * (logps - reference)).sum())
        nll -= float(logps.gather(-1, targets).sum())
        reference_nll -= float(reference.gather(-1, targets).sum())
        count += len(targets)
    count = max(count, 1.0)
    return {
        "regression_kl": kl / count,
        "regression_nll": nll / count,
        "regression_nll_champion": reference_nll / count,
    }


def judge(champion: dict[str, float], candidate: dict[str, float], limits: Limits) -> Verdict:
    """Register only a candidate that ranks held-out feedback as its users did, moves the likelihood
    of what they wanted and did not the right way, and keeps its behaviour elsewhere."""
    wanted, unwanted = int(candidate["held_out_wanted"]), int(candidate["held_out_unwanted"])
    if min(wanted, unwanted) < limits.min_held_out:
        return Verdict(
            False,
            f"held-out feedback has {wanted} wanted and {unwanted} unwanted completions; the gate needs "
            f"{limits.min_held_out} of each to rank them",
        )
    if (drifted := _drift(champion, candidate, limits)) is not None:
        return Verdict(False, drifted)
    auc, lower = candidate["reward_auc"], candidate["reward_auc_lower"]
    ranked = f"AUC {auc:.2f}, 95% lower bound {lower:.2f}"
    if not lower > 0.5 + limits.reward_margin:
        return Verdict(
            False,
            f"the candidate ranks held-out wanted above unwanted completions no better than chance by "
            f"{limits.reward_margin:.2f} ({ranked}, over {wanted} wanted and {unwanted} unwanted)",
        )
    gain, loss = candidate["wanted_logp_gain"], candidate["unwanted_logp_gain"]
    if not gain > 0:
        return Verdict(
            False,
            f"held-out completions users wanted did not become more likely ({gain:+.3f} nats/token)",
        )
    if not loss < gain:
        return Verdict(
            False,
            f"held-out completions users did not want became as much more likely as those they wanted "
            f"({loss:+.3f} against {gain:+.3f} nats/token)",
        )
    answered = "held_out_accuracy" in candidate and candidate["held_out_items"]  # a demo task's answer key
    if answered and not candidate["held_out_accuracy"] > champion["held_out_accuracy"]:
        return Verdict(
            False,
            f"held-out accuracy did not improve ({champion['held_out_accuracy']:.1%} -> "
            f"{candidate['held_out_accuracy']:.1%})",
        )
    kept = (
        f"regression {champion['regression_accuracy']:.1%} -> {candidate['regression_accuracy']:.1%}"
        if "regression_accuracy" in candidate
        else f"KL to the champion on general prompts {candidate['regression_kl']:.3f} nats/token"
    )
    return Verdict(
        True,
        f"held-out feedback ranked at {ranked}; wanted {gain:+.3f}, unwanted {loss:+.3f} nats/token; {kept}",
    )


def _drift(champion: dict[str, float], candidate: dict[str, float], limits: Limits) -> str | None:
    """Why the candidate moved too far from the champion outside its feedback, or None."""
    if "regression_accuracy" in candidate:
        drop = champion["regression_accuracy"] - candidate["regression_accuracy"]
        if drop > limits.accuracy_drop + 1e-9:  # a drop of exactly the tolerance is tolerated
            return (
                f"regression accuracy fell {drop:.1%} ({champion['regression_accuracy']:.1%} -> "
                f"{candidate['regression_accuracy']:.1%}), more than the {limits.accuracy_drop:.1%} tolerated"
            )
        return None
    kl = candidate["regression_kl"]
    if not math.isfinite(kl) or kl > limits.kl:
        return (
            f"on the general prompts the candidate moved {kl:.3f} nats/token (KL) from the champion, more "
            f"than the {limits.kl:.3f} allowed"
        )
    nll_increase = candidate["regression_nll"] - candidate["regression_nll_champion"]
    if nll_increase > limits.nll_increase:
        return (
            f"on the general prompts the champion's own answers became {nll_increase:.3f} nats/token less "
            f"likely, more than the {limits.nll_increase:.3f} allowed"
        )
    return None
