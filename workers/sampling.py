"""Picks the next token from logits: the request's logit bias and repetition penalties first, then
greedy, or temperature, top-k and top-p with a seeded generator; and the log probabilities of what
it picked, when asked for."""

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
    presence_penalty: float = 0.0  # OpenAI's: off at 0
    frequency_penalty: float = 0.0  # OpenAI's: off at 0
    repetition_penalty: float = 1.0  # transformers' and vLLM's: off at 1
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), OpenAI's

    @property
    def penalizes(self) -> bool:
        """Whether a repetition, frequency or presence penalty is set."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


LOGPROB_FLOOR = -9999.0  # what a token that cannot occur (-inf) is reported at, as OpenAI reports it


@dataclass(frozen=True)
class TokenLogprob:
    """A picked token's log probability, and the `top` most likely tokens' at its position (id,
    log probability), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(logprobs: Tensor, token_id: int, top: int) -> TokenLogprob:
    """The entry of `token_id` from one row of log probabilities [V] (`log_softmax` of the logits it
    was picked from), with the `top` most likely (at most the vocabulary)."""
    values, ids = torch.topk(logprobs, min(top, logprobs.numel()))
    ranked = tuple(zip(ids.tolist(), (max(v, LOGPROB_FLOOR) for v in values.tolist()), strict=True))
    return TokenLogprob(token_id, max(float(logprobs[token_id]), LOGPROB_FLOOR), ranked)


def make_generator(params: SamplingParams) -> torch.Generator:
    """A CPU generator seeded from `params.seed` (or at random when it is 0)."""
    seed = params.seed or secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(seed)


def adjust(
    logits: Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int], draft: list[int]
) -> None:
    """Applies the request's logit bias, then its repetition, frequency and presence penalties (in
    vLLM's order), in place, to its rows of logits [n, V]: row i follows the completion so far and
    the first i tokens of its draft, so that a drafted row is adjusted as the same row a step later.

    As OpenAI defines them, the frequency and presence penalties count the completion's tokens only;
    the repetition penalty, as transformers defines it, also the prompt's."""
    rows, vocab = logits.shape
    device = logits.device
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        logits[:, list(ids)] += torch.tensor(biases, device=device, dtype=logits.dtype)
    if not params.penalizes:
        return
    held = torch.tensor([*output_ids, *draft[: rows - 1]], dtype=torch.long, device=device)
    counts = torch.zeros(rows, vocab, device=device, dtype=logits.dtype)  # row i: completion + draft[:i]
    for row in range(rows):
        counts[row] = torch.bincount(held[: len(output_ids) + row], minlength=vocab)[:vocab]
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        penalty = params.repetition_penalty
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits))
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


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
