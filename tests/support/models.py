"""Tiny built-in models for tests, the cache-free greedy reference every cached path is held to,
versions saved as the registry carries them (and as a Llama checkpoint), and a tokenizer that never
ends a sequence (for benchmarks that want every request at its max_tokens)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from llguidance import LLMatcher

from workers.engine import Engine
from workers.grammar import vocabulary
from workers.models.builtin import TOKENIZER, new_model
from workers.models.interface import CausalLM, Tokenizer
from workers.models.llama import LlamaForCausalLM
from workers.models.loader import save_checkpoint
from workers.sampling import SamplingParams, adjust
from workers.sequence import Delta, GenerationParams

MODEL = "arith"  # the registered model the tests serve


class EndlessTokenizer:
    """The model's tokenizer with no end-of-sequence id: every request produces its max_tokens."""

    eos_ids: tuple[int, ...] = ()

    def __init__(self, inner: Tokenizer):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def tiny_model(seed: int = 0) -> CausalLM:
    """A randomly initialised `tiny` model: deterministic for a seed, fast on any CPU."""
    model, _ = new_model("tiny", seed)
    return model.eval()


def reference_greedy(
    model: CausalLM,
    prompt: str,
    max_new_tokens: int,
    adjusted: SamplingParams | None = None,
    grammar: str | None = None,
) -> list[int]:
    """Greedy decoding by full causal passes, no cache: the ground truth for every cached path
    (with the logit bias and penalties of `adjusted` applied to each step's logits, and the answer
    held to llguidance's `grammar`: the model may open a thought first, which runs free)."""
    ids = TOKENIZER.encode(prompt)
    banned = TOKENIZER.never_generated(model.vocab_size)
    matcher = None if grammar is None else LLMatcher(vocabulary(TOKENIZER, model.vocab_size), grammar)
    thinking = False
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + generated]))[0, -1]  # [V]
            logits[banned] = float("-inf")
            if matcher is not None and not thinking:
                bits = matcher.compute_bitmask()
                allowed = {
                    t for t in range(model.vocab_size) if t < 8 * len(bits) and bits[t // 8] >> t % 8 & 1
                }
                allowed |= set() if generated else {TOKENIZER.think_id}
                logits[[t for t in range(model.vocab_size) if t not in allowed]] = float("-inf")
            if adjusted is not None:
                adjust(logits[None], adjusted, ids, generated, [])
            token = int(logits.argmax())
            if matcher is not None:
                if token in (TOKENIZER.think_id, TOKENIZER.end_think_id):
                    thinking = token == TOKENIZER.think_id
                elif not thinking:
                    assert matcher.consume_token(token), matcher.get_error()
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


def save_as_llama(model: LlamaForCausalLM, directory: Path) -> Path:
    """The built-in model as the Llama checkpoint it is in Hugging Face's layout (the features of q
    and k reordered from rotated pairs to rotated halves), with the byte tokenizer: a Llama-family
    model that already knows the arith task, for the LoRA loop."""
    from safetensors.torch import save_file

    c = model.config
    d = c.head_dim

    def halves(weight: torch.Tensor) -> torch.Tensor:  # [H*D, dim]: pairs (2i, 2i+1) -> (i, i+D/2)
        return weight.view(-1, d // 2, 2, weight.shape[1]).transpose(1, 2).reshape(weight.shape)

    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    for name in state:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            state[name] = halves(state[name])
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": TOKENIZER.bos_id, "eos_token_id": TOKENIZER.eos_id,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    TOKENIZER.save(directory)
    return directory


def arith_general_prompts(path: Path) -> Path:
    """The demo model's general prompts (REFLOW_GENERAL_PROMPTS_FILE): sums of its base range, the
    whole world it knows, where everyday chat would be noise to it. Only its own answers are used."""
    from feedback.tasks.arith import Arith

    path.write_text("\n".join(Arith().base_prompts(64, random.Random(0))) + "\n")
    return path
