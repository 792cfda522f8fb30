"""Trains the demo base model on in-range `arith` problems."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from feedback.tasks.arith import format_prompt, reasoning, sample_operands, training_example
from workers.models.builtin import ModelConfig, Transformer, init_weights
from workers.models.byte_tokenizer import ByteTokenizer


@dataclass(frozen=True)
class PretrainConfig:
    """Base-model training run.

    The defaults train `arith-small` in about a minute on two CPU threads to 99-100%
    greedy accuracy on 0-49 operands and about 25% on 0-99.
    """

    preset: str = "arith-small"
    lo: int = 0  # operands are drawn uniformly from lo..hi (inclusive)
    hi: int = 49
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # Share of examples whose thought is cut short, as a reasoning budget would: the
    # model learns to answer after a forced `</think>` (which itself gets no loss).
    truncated_fraction: float = 0.1
    seed: int = 0


def train_base_model(
    config: PretrainConfig,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int, float], None] | None = None,
) -> Transformer:
    """A model of `config.preset` trained on `config`; deterministic for a seed on CPU.

    `progress(step, total_steps, loss)` is called after every step (step counts from 1).
    """
    model = Transformer(ModelConfig.from_name(config.preset))
    init_weights(model, config.seed)
    model.to(device).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(0.9, 0.98),
    )
    tokenizer = ByteTokenizer()
    rng = random.Random(config.seed)
    for step in range(1, config.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        tokens, mask = _batch(tokenizer, config, rng)
        tokens, mask = tokens.to(device), mask.to(device)
        logits = model(tokens[:, :-1])  # [B, T-1, V]
        losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        weights = mask[:, 1:].float()  # [B, T-1]: loss on predicted completion tokens
        loss = (losses * weights).sum() / weights.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        if progress is not None:
            progress(step, config.steps, loss.item())
    return model.eval()


class Schedule(Protocol):
    """What the learning-rate schedule reads from a training recipe."""

    lr: float
    warmup_steps: int
    steps: int
    min_lr_ratio: float


def learning_rate(config: Schedule, step: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * done))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def _batch(
    tokenizer: ByteTokenizer, config: PretrainConfig, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch of in-range examples: token ids and loss mask, both [B, T]."""
    rows: list[tuple[list[int], list[int]]] = []
    for a, b in sample_operands(config.batch_size, config.lo, config.hi, rng):
        thought = reasoning(a, b)
        truncated = rng.random() < config.truncated_fraction
        if truncated:
            thought = thought[: rng.randrange(len(thought))]
        ids, mask = training_example(tokenizer, format_prompt(a, b), str(a + b), thought)
        if truncated:
            mask[ids.index(tokenizer.end_think_id)] = 0
        rows.append((ids, mask))
    return pad_rows(rows, tokenizer.pad_id)


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and loss masks of `rows`, right-padded into two [B, T] tensors."""
    width = max((len(ids) for ids, _ in rows), default=1)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, row_mask) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = torch.tensor(row_mask)
    return tokens, mask
