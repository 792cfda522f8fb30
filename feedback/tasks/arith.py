"""The `arith` demo task: prompts, canonical reasoning, the oracle, datasets and greedy accuracy."""

from __future__ import annotations

import random
import re

import torch

from workers.models.builtin import Transformer
from workers.models.byte_tokenizer import ByteTokenizer

# Canonical operands only ("7+38=", not "07+38=" or " 7+38="), so format and parse are inverses.
_PROMPT = re.compile(r"(0|[1-9][0-9]*)\+(0|[1-9][0-9]*)=")


def format_prompt(a: int, b: int) -> str:
    """The prompt "A+B=" for non-negative integers a and b."""
    if a < 0 or b < 0:
        raise ValueError(f"arith operands must be non-negative, got {a} and {b}")
    return f"{a}+{b}="


def parse_prompt(prompt: str) -> tuple[int, int] | None:
    """The operands of an `arith` prompt, or None when `prompt` is not one."""
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def reasoning(a: int, b: int) -> str:
    """The canonical thought: column sums from the ones digit up, with carries.

    47+38 gives "7+8=15, 4+3+1=8"; the answer is the last sum followed by the
    ones digits of the earlier sums, last to first ("85"). The shorter operand
    is padded with zeros: 5+38 gives "5+8=13, 0+3+1=4".
    """
    digits_a = [int(d) for d in reversed(str(a))]
    digits_b = [int(d) for d in reversed(str(b))]
    steps = []
    carry = 0
    for i in range(max(len(digits_a), len(digits_b))):
        x = digits_a[i] if i < len(digits_a) else 0
        y = digits_b[i] if i < len(digits_b) else 0
        total = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
        carry = total // 10
    return ", ".join(steps)


def is_correct(prompt: str, answer_text: str) -> bool:
    """The oracle: the stripped answer is exactly the sum; False for non-arith prompts."""
    operands = parse_prompt(prompt)
    if operands is None:
        return False
    return answer_text.strip() == str(sum(operands))


def sample_operands(n: int, lo: int, hi: int, rng: random.Random) -> list[tuple[int, int]]:
    """`n` operand pairs drawn uniformly and independently from lo..hi (inclusive)."""
    if not 0 <= lo <= hi:
        raise ValueError(f"need 0 <= lo <= hi, got lo={lo} hi={hi}")
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]


def training_example(
    tokenizer: ByteTokenizer, prompt: str, answer: str, thought: str | None
) -> tuple[list[int], list[int]]:
    """Token ids of `<bos>prompt<think>thought</think>answer<eos>` and its loss mask.

    The mask is 1 on the completion (everything the model generates, the
    special tokens included) and 0 on `<bos>` and the prompt. Without a
    thought the completion is `answer<eos>`, with no think tags.
    """
    prompt_ids = tokenizer.encode(prompt)
    completion = [*tokenizer.encode(answer, bos=False), tokenizer.eos_id]
    if thought is not None:
        thought_ids = tokenizer.encode(thought, bos=False)
        completion = [tokenizer.think_id, *thought_ids, tokenizer.end_think_id, *completion]
    return prompt_ids + completion, [0] * len(prompt_ids) + [1] * len(completion)


def greedy_answers(
    model: Transformer,
    tokenizer: ByteTokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int = 48,
    batch_size: int = 256,
) -> list[str]:
    """Greedy answer text for each prompt, decoded `batch_size` prompts at a time with the KV cache.

    The answer is the text after `</think>` (after the prompt when the model does not
    think) up to `<eos>`; it is empty when a thought is never closed.
    """
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        for generated in _greedy_tokens(model, tokenizer, chunk, max_new_tokens):
            answers.append(_answer_text(tokenizer, generated))
    return answers


def accuracy(
    model: Transformer,
    tokenizer: ByteTokenizer,
    operands: list[tuple[int, int]],
    **kw: int,
) -> float:
    """Share of `operands` whose greedy answer is correct; `kw` goes to `greedy_answers`."""
    prompts = [format_prompt(a, b) for a, b in operands]
    answers = greedy_answers(model, tokenizer, prompts, **kw)
    return sum(is_correct(p, t) for p, t in zip(prompts, answers, strict=True)) / len(prompts)


@torch.inference_mode()
def _greedy_tokens(
    model: Transformer, tokenizer: ByteTokenizer, prompts: list[str], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations of one batch of prompts, each ending at `<eos>` or a length limit."""
    device = model.output.weight.device
    encoded = [tokenizer.encode(p) for p in prompts]
    n = len(encoded)
    lengths = torch.tensor([len(ids) for ids in encoded], device=device)  # [B]
    max_len = int(lengths.max())
    limit = model.config.max_seq_len
    if max_len > limit:
        raise ValueError(f"an arith prompt of {max_len} tokens exceeds max_seq_len={limit}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    tokens = torch.full((n, max_len), tokenizer.pad_id, dtype=torch.long)
    for i, ids in enumerate(encoded):
        tokens[i, : len(ids)] = torch.tensor(ids)
    tokens = tokens.to(device)  # [B, T], right-padded
    cache = model.new_cache(n)
    slots = torch.arange(n, device=device)  # [B]
    positions = torch.arange(max_len, device=device).expand(n, max_len)  # [B, T]
    # Padding is written past each row's prompt, then overwritten by its generated
    # tokens before any query can attend to it (the mask keeps key_pos <= query_pos).
    banned = tokenizer.never_generated(model.config.vocab_size)
    logits = model(tokens, positions, cache, slots)  # [B, T, V]
    logits[..., banned] = float("-inf")  # as the serving engine does
    next_ids = logits[slots, lengths - 1].argmax(-1)  # [B]
    next_pos = lengths.clone()  # [B]: where each row's next token goes
    # A token at position p is fed back only if the one it predicts is still allowed.
    feed_below = (lengths + max_new_tokens - 1).clamp(max=limit)  # [B]
    generated: list[list[int]] = [[] for _ in range(n)]
    active = slots
    while True:
        for row, token in zip(active.tolist(), next_ids.tolist(), strict=True):
            generated[row].append(token)
        keep = (next_ids != tokenizer.eos_id) & (next_pos[active] < feed_below[active])
        active, next_ids = active[keep], next_ids[keep]
        if active.numel() == 0:
            break
        logits = model(next_ids[:, None], next_pos[active, None], cache, active)  # [b, 1, V]
        logits[..., banned] = float("-inf")
        next_pos[active] += 1
        next_ids = logits[:, -1].argmax(-1)  # [b]
    return generated


def _answer_text(tokenizer: ByteTokenizer, generated: list[int]) -> str:
    """The answer part of a continuation: after `</think>` if the model thought, up to `<eos>`."""
    if tokenizer.eos_id in generated:
        generated = generated[: generated.index(tokenizer.eos_id)]
    if generated and generated[0] == tokenizer.think_id:
        if tokenizer.end_think_id not in generated:
            return ""
        generated = generated[generated.index(tokenizer.end_think_id) + 1 :]
    return tokenizer.decode(generated)
