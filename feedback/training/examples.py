"""Examples as the model is taught them: token ids with a loss mask on the completion, padded into
batches; and the learning-rate schedule of every training run."""

from __future__ import annotations

import math
from typing import Protocol

import torch

from feedback.tasks.task import Example
from workers.models.interface import Tokenizer
from workers.models.prompts import Prompt, prompt_ids


def training_example(
    tokenizer: Tokenizer, prompt: Prompt, answer: str, thought: str | None
) -> tuple[list[int], list[int]]:
    """Token ids of `<bos>prompt<think>thought</think>answer<eos>` and its loss mask; a
    conversation's prompt is rendered with the chat template the model serves with.

    The mask is 1 on the completion (everything the model generates, the
    special tokens included) and 0 on `<bos>` and the prompt. Without a
    thought (or a model that does not reason) the completion is `answer<eos>`,
    with no think tags.
    """
    given = prompt_ids(tokenizer, prompt)
    completion = [*tokenizer.encode(answer, bos=False), tokenizer.eos_ids[0]]
    markers = tokenizer.reasoning_markers
    if thought is not None and markers is not None:
        completion = [markers[0], *tokenizer.encode(thought, bos=False), markers[1], *completion]
    return given + completion, [0] * len(given) + [1] * len(completion)


def example_rows(
    tokenizer: Tokenizer, examples: list[Example], *, answers_only: bool = False
) -> list[tuple[list[int], list[int]]]:
    """The token ids and loss mask of each example; with `answers_only`, the mask leaves out a
    thought and its tags (what a user judged is the answer they saw)."""
    rows = [training_example(tokenizer, e.prompt, e.answer, e.thought) for e in examples]
    if not answers_only:
        return rows
    answers = [len(tokenizer.encode(e.answer, bos=False)) + 1 for e in examples]  # + <eos>
    return [(ids, [0] * (len(ids) - n) + mask[-n:]) for (ids, mask), n in zip(rows, answers, strict=True)]


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and loss masks of `rows`, right-padded into two [B, T] tensors."""
    width = max((len(ids) for ids, _ in rows), default=1)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, row_mask) in enumerate(rows):
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = torch.tensor(row_mask)
    return tokens, mask


class Schedule(Protocol):
    """What the learning-rate schedule reads from a training recipe."""

    @property
    def lr(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def min_lr_ratio(self) -> float: ...


def learning_rate(config: Schedule, step: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * done))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)
