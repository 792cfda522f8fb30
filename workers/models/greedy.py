"""Batched decoding outside the engine, through the KV cache, greedy or sampled at a temperature:
answers to whole evaluation sets for the fine-tune job's gate, the base model's bootstrap, offline
simulations and the benchmarks' before-and-after measures."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.models.interface import CausalLM, Tokenizer
from workers.models.kv_cache import BLOCK_SIZE
from workers.models.prompts import Prompt, prompt_ids


def greedy_answers(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 48,
    batch_size: int = 256,
) -> list[str]:
    """Greedy answer text for each prompt (text, or a conversation rendered with the model's chat
    template), decoded `batch_size` prompts at a time with the KV cache.

    The answer is the text after `</think>` (after the prompt when the model does not
    think) up to `<eos>`; it is empty when a thought is never closed.
    """
    return [answer for _, answer in completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                                 batch_size=batch_size)]  # fmt: skip


def completions(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    max_new_tokens: int = 48,
    batch_size: int = 256,
) -> list[tuple[str | None, str]]:
    """(thought, answer) of each prompt's continuation, greedy or each token drawn at `temperature`
    with `generator` (a CPU one: the same seed gives the same text on any device). The thought is
    None when the model did not think, or never closed its thought (the answer is empty then)."""
    found: list[tuple[str | None, str]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        for generated in _continuations(model, tokenizer, chunk, max_new_tokens, temperature, generator):
            found.append(_split(tokenizer, generated))
    return found


def greedy_ids(
    model: CausalLM, tokenizer: Tokenizer, prompts: Sequence[Prompt], *, max_new_tokens: int
) -> list[list[int]]:
    """The greedy token ids after each prompt (one batch), each ending at `<eos>` or after
    `max_new_tokens`."""
    return _continuations(model, tokenizer, prompts, max_new_tokens, 0.0, None)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of [B, V] logits: the likeliest, or drawn at `temperature`."""
    if temperature == 0:
        return logits.argmax(-1)
    probabilities = (logits.float().cpu() / temperature).softmax(-1)
    return torch.multinomial(probabilities, 1, generator=generator)[:, 0].to(logits.device)


@torch.inference_mode()
def _continuations(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """Continuations of one batch of prompts, each ending at `<eos>` or a length limit."""
    device = model.device
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    n = len(encoded)
    lengths = torch.tensor([len(ids) for ids in encoded], device=device)  # [B]
    max_len = int(lengths.max())
    limit = model.max_seq_len
    if max_len > limit:
        raise ValueError(f"a prompt of {max_len} tokens exceeds max_seq_len={limit}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    tokens = torch.full((n, max_len), tokenizer.pad_id, dtype=torch.long)
    for i, ids in enumerate(encoded):
        tokens[i, : len(ids)] = torch.tensor(ids)
    tokens = tokens.to(device)  # [B, T], right-padded
    # Each row owns a contiguous run of blocks for its longest continuation; block 0 is scratch.
    held = min(max_len + max_new_tokens, limit)
    per_row = -(-held // BLOCK_SIZE)
    cache = model.new_cache(1 + n * per_row)
    tables = [list(range(1 + i * per_row, 1 + (i + 1) * per_row)) for i in range(n)]
    rows = torch.arange(n, device=device)  # [B]
    banned = tokenizer.never_generated(model.vocab_size)
    eos = torch.tensor(tokenizer.eos_ids, device=device)
    view = cache.view(tables, [list(range(len(ids))) for ids in encoded], device)  # padding left out
    logits = model(tokens, cache, view, at=rows * max_len + lengths - 1)  # [B, V]: each last token's
    logits[..., banned] = float("-inf")  # as the serving engine does
    next_ids = _pick(logits, temperature, generator)  # [B]
    next_pos = lengths.clone()  # [B]: where each row's next token goes
    # A token at position p is fed back only if the one it predicts is still allowed.
    feed_below = (lengths + max_new_tokens - 1).clamp(max=limit)  # [B]
    generated: list[list[int]] = [[] for _ in range(n)]
    active = rows
    while True:
        for row, token in zip(active.tolist(), next_ids.tolist(), strict=True):
            generated[row].append(token)
        keep = ~torch.isin(next_ids, eos) & (next_pos[active] < feed_below[active])
        active, next_ids = active[keep], next_ids[keep]
        if active.numel() == 0:
            break
        view = cache.view([tables[r] for r in active.tolist()], next_pos[active, None].tolist(), device)
        logits = model(next_ids[:, None], cache, view)  # [b, 1, V]
        logits[..., banned] = float("-inf")
        next_pos[active] += 1
        next_ids = _pick(logits[:, -1], temperature, generator)  # [b]
    return generated


def _split(tokenizer: Tokenizer, generated: list[int]) -> tuple[str | None, str]:
    """The thought (None without one) and the answer of a continuation: the answer is after
    `</think>` if the model thought, up to `<eos>`; empty when the thought is never closed."""
    ends = [i for i, token in enumerate(generated) if token in tokenizer.eos_ids]
    generated = generated[: ends[0]] if ends else generated
    markers = tokenizer.reasoning_markers
    if markers is not None and generated and generated[0] == markers[0]:
        if markers[1] not in generated:
            return None, ""
        close = generated.index(markers[1])
        return tokenizer.decode(generated[1:close]), tokenizer.decode(generated[close + 1 :])
    return None, tokenizer.decode(generated)
