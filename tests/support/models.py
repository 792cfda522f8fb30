"""Tiny built-in models for tests, the cache-free greedy reference every cached path is held to,
and versions saved as the registry carries them (and as a Llama checkpoint)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from workers.engine import Engine
from workers.models.builtin import TOKENIZER, Transformer, new_model
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


def save_as_llama(model: Transformer, directory: Path) -> Path:
    """The built-in model as the Llama checkpoint it is in Hugging Face's names (q, k and v split
    out of wqkv, their features reordered from rotated pairs to rotated halves), with the byte
    tokenizer: a Llama-family model that already knows the arith task, for the LoRA loop."""
    from safetensors.torch import save_file

    c = model.config
    d = c.head_dim

    def halves(weight: torch.Tensor) -> torch.Tensor:  # [H*D, dim]: pairs (2i, 2i+1) -> (i, i+D/2)
        return weight.view(c.n_heads, d // 2, 2, c.dim).transpose(1, 2).reshape(c.n_heads * d, c.dim)

    state = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
             "lm_head.weight": model.output.weight}  # fmt: skip
    for i, block in enumerate(model.layers):
        q, k, v = block.attention.wqkv.weight.chunk(3)  # type: ignore[union-attr]
        prefix = f"model.layers.{i}"
        state |= {
            f"{prefix}.self_attn.q_proj.weight": halves(q), f"{prefix}.self_attn.k_proj.weight": halves(k),
            f"{prefix}.self_attn.v_proj.weight": v,
            f"{prefix}.self_attn.o_proj.weight": block.attention.wo.weight,
            f"{prefix}.mlp.gate_proj.weight": block.feed_forward.w1.weight,
            f"{prefix}.mlp.up_proj.weight": block.feed_forward.w3.weight,
            f"{prefix}.mlp.down_proj.weight": block.feed_forward.w2.weight,
            f"{prefix}.input_layernorm.weight": block.attention_norm.weight,
            f"{prefix}.post_attention_layernorm.weight": block.ffn_norm.weight,
        }  # type: ignore[union-attr]  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous() for n, t in state.items()}, str(directory / "model.safetensors"))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
        "hidden_size": c.dim, "intermediate_size": c.hidden_dim, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_heads,
        "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_base,
        "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": TOKENIZER.bos_id,
        "eos_token_id": TOKENIZER.eos_id,
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
