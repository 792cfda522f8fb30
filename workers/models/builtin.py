"""The built-in model: a preset of the one decoder (llama.py) over byte-level tokens, and the map
between its saved weights and the decoder's.

Its `config.json` says `"model_type": "reflow"`, which is how the loader tells it from others. Its
files keep the names it has always been saved under, as gpt-fast names a Llama's weights (its
`convert_hf_checkpoint` maps Hugging Face's names onto them; this map goes the other way, and back).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from workers.models.byte_tokenizer import ByteTokenizer
from workers.models.llama import CONFIG_FILE, WEIGHTS_FILE, LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "reflow"  # config.json's model_type, as Hugging Face configs name their architecture
TOKENIZER = ByteTokenizer()  # every built-in model's

# Saved name -> the decoder's weights it holds, stacked in rows; `{}` is a layer's number.
WEIGHT_MAP: dict[str, tuple[str, ...]] = {
    "tok_embeddings.weight": ("model.embed_tokens.weight",),
    "layers.{}.attention_norm.weight": ("model.layers.{}.input_layernorm.weight",),
    "layers.{}.attention.wqkv.weight": tuple(f"model.layers.{{}}.self_attn.{p}_proj.weight" for p in "qkv"),
    "layers.{}.attention.wo.weight": ("model.layers.{}.self_attn.o_proj.weight",),
    "layers.{}.ffn_norm.weight": ("model.layers.{}.post_attention_layernorm.weight",),
    "layers.{}.feed_forward.w1.weight": ("model.layers.{}.mlp.gate_proj.weight",),
    "layers.{}.feed_forward.w3.weight": ("model.layers.{}.mlp.up_proj.weight",),
    "layers.{}.feed_forward.w2.weight": ("model.layers.{}.mlp.down_proj.weight",),
    "norm.weight": ("model.norm.weight",),
    "output.weight": ("lm_head.weight",),
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a built-in model, as its `config.json` has it, and the files it is saved as (`write`);
    `from_name` gives the named presets."""

    vocab_size: int = 272  # 261 byte-level ids, padded to a multiple of 16
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    hidden_dim: int = 384  # SwiGLU width
    max_seq_len: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """The preset called `name` (see PRESETS)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None

    def to_dict(self) -> dict[str, int | float | str]:
        """JSON-ready form, written as `config.json` beside the weights."""
        return {"model_type": MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, int | float | str]) -> ModelConfig:
        """Inverse of `to_dict` (configs written before `model_type` are read too); unknown keys
        are an error, not silently dropped."""
        data = {k: v for k, v in data.items() if k != "model_type"}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]  # JSON values; the dataclass's types are not checked

    def llama(self) -> LlamaConfig:
        """The decoder's config: every head its own keys and values, no biases, untied, q and k
        turned in pairs as it was trained; padded to 4 rows in float32 (`min_batch_rows`)."""
        return LlamaConfig(
            model_type=MODEL_TYPE, vocab_size=self.vocab_size, hidden_size=self.dim,
            intermediate_size=self.hidden_dim, num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads, num_key_value_heads=self.n_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_seq_len, rms_norm_eps=self.norm_eps, rope_theta=self.rope_base,
            rope_scaling=None, tie_word_embeddings=False, qkv_bias=False, o_bias=False, qk_norm=False,
            sliding_window=0, interleaved_rope=True, float32_batch_rows=4,
        )  # fmt: skip

    def write(self, state: dict[str, Tensor], dtype: torch.dtype, directory: Path) -> None:
        """Writes `model.safetensors` under the built-in model's names and this config as
        `config.json` (the dtype is the weights' own)."""
        saved = {name: torch.cat([state[p] for p in parts]) for name, parts in saved_names(self.n_layers)}
        save_file(saved, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


PRESETS: dict[str, ModelConfig] = {
    # Tests: trains in seconds, learns nothing useful.
    "tiny": ModelConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_seq_len=64),
    # The demo model for the `arith` task.
    "arith-small": ModelConfig(dim=128, n_layers=4, n_heads=4, hidden_dim=384, max_seq_len=128),
    # Wider variant, for GPUs and benchmarks.
    "arith-base": ModelConfig(dim=256, n_layers=6, n_heads=8, hidden_dim=768, max_seq_len=256),
}


def saved_names(n_layers: int) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Each saved weight's name with the decoder's weights it holds (WEIGHT_MAP, layer by layer)."""
    for saved, parts in WEIGHT_MAP.items():
        for layer in range(n_layers) if "{}" in saved else (0,):
            yield saved.format(layer), tuple(p.format(layer) for p in parts)


def to_decoder(saved: dict[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """The saved weights under the decoder's names (wqkv split in q, k and v); names the map does
    not know are kept, for the strict load to refuse."""
    state = dict(saved)
    for name, parts in saved_names(n_layers):
        if name in state:
            state.update(zip(parts, state.pop(name).chunk(len(parts)), strict=True))
    return state


def from_checkpoint(
    directory: Path,
    config_json: dict[str, Any],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    max_len: int = 0,
) -> LlamaForCausalLM:
    """The model `config_json` (its `config.json`, read) describes, weights from `directory`
    (safetensors, never a pickle) on `device`, cast to `dtype` (None: as saved, float32 as
    trained), its context capped at `max_len`."""
    config = ModelConfig.from_dict(config_json)
    saved = load_file(str(directory / WEIGHTS_FILE), device=str(device))
    if dtype is not None:
        saved = {name: t.to(dtype) for name, t in saved.items()}
    with torch.device("meta"):
        model = LlamaForCausalLM(config.llama(), config, max_len)
    return model.load_weights(to_decoder(saved, config.n_layers))


def new_model(preset: str, seed: int) -> tuple[LlamaForCausalLM, ByteTokenizer]:
    """A model of the named preset, its weights freshly initialised from `seed`, and its tokenizer."""
    config = ModelConfig.from_name(preset)
    model = LlamaForCausalLM(config.llama(), config)
    init_weights(model, seed)
    return model, TOKENIZER


def init_weights(model: nn.Module, seed: int) -> None:
    """Small normal init (std 0.02) for every linear and embedding weight, seeded, in module order
    (q, k and v one after another: the draws of the saved wqkv)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
