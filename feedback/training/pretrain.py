"""Trains the demo base model, the built-in model from scratch, on a task's base distribution."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from feedback.tasks.task import Task, reference_example
from feedback.training.examples import learning_rate, pad_rows, training_example
from workers.models.builtin import new_model
from workers.models.interface import CausalLM, Tokenizer


@dataclass(frozen=True)
class PretrainConfig:
    """Base-model training run.

    The defaults train `arith-small` on the `arith` task in about a minute on two CPU threads
    to 99-100% greedy accuracy on its base range (0-49) and about 25% on live traffic's (0-99).
    """

    preset: str = "arith-small"
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
    task: Task,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """A model of `config.preset` trained on `task`'s base distribution, and its tokenizer;
    deterministic for a seed on CPU.

    `progress(step, total_steps, loss)` is called after every step (step counts from 1).
    """
    built, tokenizer = new_model(config.preset, config.seed)
    model = built.to(device).train()
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
    rng = random.Random(config.seed)
    for step in range(1, config.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        tokens, mask = _batch(tokenizer, task, config, rng)
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
    return model.eval(), tokenizer


def _batch(
    tokenizer: Tokenizer, task: Task, config: PretrainConfig, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch of the base distribution's examples: token ids and loss mask, both [B, T]."""
    closes = tokenizer.reasoning_markers[1] if tokenizer.reasoning_markers else None
    rows: list[tuple[list[int], list[int]]] = []
    for prompt in task.base_prompts(config.batch_size, rng):
        example = reference_example(task, prompt)
        thought = example.thought
        if thought and closes is not None and rng.random() < config.truncated_fraction:
            ids, mask = training_example(
                tokenizer, prompt, example.answer, thought[: rng.randrange(len(thought))]
            )
            mask[ids.index(closes)] = 0  # the forced `</think>` is not learned, only what follows it
        else:
            ids, mask = training_example(tokenizer, prompt, example.answer, thought)
        rows.append((ids, mask))
    return pad_rows(rows, tokenizer.pad_id)
