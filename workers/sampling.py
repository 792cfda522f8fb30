"""Picks the next token from logits: greedy, temperature, top-k and top-p, with a seeded generator."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens; temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # 0 = a fresh random seed


def make_generator(params: SamplingParams) -> torch.Generator:
    """A CPU generator seeded from `params.seed` (or at random when it is 0)."""
    seed = params.seed or secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(seed)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Next token id from one row of logits [V]; the same seed and logits give the same token."""
    if params.temperature <= 0.0:
        return int(torch.argmax(logits))
    scores = logits.detach().float().cpu() / params.temperature  # [V]
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
