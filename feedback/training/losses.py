"""Sequence log-probabilities and the two preference losses the fine-tune job trains with, in plain
PyTorch: KTO on single rated completions, DPO on pairs.

For a completion y of prompt x, the implied reward is r = log pi(y|x) - log pi_ref(y|x), the
policy's log-likelihood ratio to the frozen reference (the champion).

KTO (Ethayarajh et al., 2024, "KTO: Model Alignment as Prospect Theoretic Optimization") compares
r with a reference point z0, an estimate of KL(pi || pi_ref) from completions paired with prompts
they do not belong to, detached and clamped at zero:

    desirable:    lambda_D * (1 - sigmoid(beta * (r - z0)))
    undesirable:  lambda_U * (1 - sigmoid(beta * (z0 - r)))

DPO (Rafailov et al., 2023) on a pair, chosen y_w over rejected y_l, with label smoothing eps for
labels that are wrong a fraction eps of the time (conservative DPO, Mitchell 2023):

    -(1 - eps) * log sigmoid(beta * (r_w - r_l)) - eps * log sigmoid(-beta * (r_w - r_l))

Both are bounded in how hard one example pulls (sigmoid-shaped), which is what keeps a share of
flipped labels from wrecking a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.models.interface import CausalLM


@dataclass(frozen=True)
class CompletionLogits:
    """The logits of the N positions of a batch that predict a completion token, row by row."""

    logits: Tensor  # [N, V]
    targets: Tensor  # [N]: the completion token each position predicts
    rows: Tensor  # [N]: the row each is in, ascending


def completion_logits(model: CausalLM, tokens: Tensor, mask: Tensor) -> CompletionLogits:
    """`model`'s logits where they predict a masked (completion) token: `tokens` and `mask` are
    [B, T], mask[b, t] = 1 where token t is part of the completion. The output head runs on those
    positions alone (`at`): a prompt's and the padding's logits are never used, and a real model's
    head is its widest product (SmolLM2's 49,152 words, against 576 wide layers)."""
    rows, columns = mask[:, 1:].nonzero(as_tuple=True)  # position t predicts token t + 1
    logits = model(tokens[:, :-1], at=rows * (tokens.shape[1] - 1) + columns)
    return CompletionLogits(logits, tokens[rows, columns + 1], rows)


def sequence_logps(model: CausalLM, tokens: Tensor, mask: Tensor) -> Tensor:
    """Sum of log pi(token) over the masked (completion) tokens of each row: [B] (`completion_logits`)."""
    found = completion_logits(model, tokens, mask)
    logps = -F.cross_entropy(found.logits, found.targets, reduction="none")  # [N]
    return logps.new_zeros(tokens.shape[0]).index_add(0, found.rows, logps)


@dataclass(frozen=True)
class KtoResult:
    """The loss and what it was made of, for logging."""

    loss: Tensor  # scalar, differentiable in the policy's log-probs
    kl: float  # the reference point z0
    rewards: Tensor  # r per example, detached: [B]


def kto_loss(
    policy_logps: Tensor,
    reference_logps: Tensor,
    kl_policy_logps: Tensor,
    kl_reference_logps: Tensor,
    desirable: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> KtoResult:
    """Mean KTO loss over a batch.

    policy_logps, reference_logps: log pi(y|x) of each example's own completion, [B].
    kl_policy_logps, kl_reference_logps: the same for mismatched (x, y') pairs, [B'].
    desirable: bool [B], True for thumbs up, False for thumbs down.
    """
    z0 = (kl_policy_logps - kl_reference_logps).mean().clamp(min=0).detach()
    rewards = policy_logps - reference_logps.detach()
    desirable = desirable.bool()
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (rewards - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rewards))),
    )
    return KtoResult(losses.mean(), float(z0), rewards.detach())


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    reference_chosen_logps: Tensor,
    reference_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Mean DPO loss over pairs; every argument is [B] sequence log-probabilities (the references'
    are detached here)."""
    margin = (chosen_logps - reference_chosen_logps.detach()) - (
        rejected_logps - reference_rejected_logps.detach()
    )
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(
        -beta * margin
    )
    return losses.mean()
