"""Tiny built-in models for tests, the cache-free greedy reference every cached path is held to,
and versions saved as the registry carries them."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.engine import Engine
from workers.models.builtin import TOKENIZER, new_model
from workers.models.interface import CausalLM
from workers.models.loader import save_checkpoint
from workers.sequence import Delta, GenerationParams

MODEL = "arith"  # the registered model the tests serve


def tiny_model(seed: int = 0) -> CausalLM:
    """A randomly initialised `tiny` model: deterministic for a seed, fast on any CPU."""
    model, _ = new_model("tiny", seed)
    return model.eval()


def reference_greedy(model: CausalLM, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy decoding by full causal passes, no cache: the ground truth for every cached path."""
    ids = TOKENIZER.encode(prompt)
    banned = TOKENIZER.never_generated(model.vocab_size)
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + generated]))[0, -1]  # [V]
            logits[banned] = float("-inf")
            token = int(logits.argmax())
            generated.append(token)
            if token in TOKENIZER.eos_ids:
                break
    return generated


def save_model(model: CausalLM, directory: Path) -> Path:
    """Writes weights, config and tokenizer as a registered version carries them."""
    return save_checkpoint(model, TOKENIZER, directory)


async def collect(engine: Engine, prompt: str, params: GenerationParams, version: str = "1") -> Delta:
    """Every delta of one completion of `MODEL`/`version` in `engine`, merged."""
    out = Delta()
    async for delta in engine.generate(MODEL, version, TOKENIZER.encode(prompt), params):
        out.merge(delta)
    return out
