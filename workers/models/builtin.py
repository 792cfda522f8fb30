"""The built-in model: a small Llama-style decoder (RMSNorm, RoPE, SwiGLU) over byte-level tokens.

Its `config.json` says `"model_type": "reflow"`, which is how the loader tells it from others.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from workers.models.byte_tokenizer import ByteTokenizer
from workers.models.kv_cache import CacheView, PagedKVCache, paged_attention
from workers.models.lora import AdapterRows

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_TYPE = "reflow"  # config.json's model_type, as Hugging Face configs name their architecture
TOKENIZER = ByteTokenizer()  # every built-in model's


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder; `from_name` gives the named presets."""

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


PRESETS: dict[str, ModelConfig] = {
    # Tests: trains in seconds, learns nothing useful.
    "tiny": ModelConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_seq_len=64),
    # The demo model for the `arith` task.
    "arith-small": ModelConfig(dim=128, n_layers=4, n_heads=4, hidden_dim=384, max_seq_len=128),
    # Wider variant, for GPUs and benchmarks.
    "arith-base": ModelConfig(dim=256, n_layers=6, n_heads=8, hidden_dim=768, max_seq_len=256),
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_table(config: ModelConfig, device: torch.device | None = None) -> Tensor:
    """cos/sin of every (position, frequency) pair: [max_seq_len, head_dim/2, 2]."""
    half = config.head_dim // 2
    freqs = 1.0 / (config.rope_base ** (torch.arange(half, device=device).float() / half))
    angles = torch.outer(torch.arange(config.max_seq_len, device=device).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotates pairs of features of x: [B, T, H, D] by rope: [B, T, D/2, 2]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, T, H, D/2, 2]
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]  # [B, T, 1, D/2]
    rotated = torch.stack(
        [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin],
        dim=-1,
    )
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Multi-head causal self-attention with rotary positions."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.config = config
        self.layer = layer
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(
        self, x: Tensor, rope: Tensor, cache: PagedKVCache | None, view: CacheView | None, mask: Tensor | None
    ) -> Tensor:
        b, t, _ = x.shape
        h, d = self.config.n_heads, self.config.head_dim
        q, k, v = self.wqkv(x).view(b, t, 3, h, d).unbind(2)  # each [B, T, H, D]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # [B, H, T, D]
        if cache is None or view is None or mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = paged_attention(cache, self.layer, view, q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, h * d))  # [B, T, dim]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self, x: Tensor, rope: Tensor, cache: PagedKVCache | None, view: CacheView | None, mask: Tensor | None
    ) -> Tensor:
        x = x + self.attention(self.attention_norm(x), rope, cache, view, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model over byte-level tokens."""

    rope: Tensor  # a buffer: [max_seq_len, head_dim/2, 2]

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(config), persistent=False)

    def forward(
        self,
        tokens: Tensor,
        cache: PagedKVCache | None = None,
        view: CacheView | None = None,
        adapters: AdapterRows | None = None,
    ) -> Tensor:
        """Logits [B, T, vocab] for tokens [B, T].

        Without a cache this is the causal full-sequence pass used in training;
        with one, `view` places the tokens in the cache's blocks. It takes no adapters: the
        demo model is fine-tuned in full (its layers are not named as Hugging Face names them).
        """
        if adapters is not None:
            raise ValueError("the built-in model takes no LoRA adapters")
        b, t = tokens.shape
        positions = view.positions if view is not None else torch.arange(t, device=tokens.device).expand(b, t)
        x = self.tok_embeddings(tokens)  # [B, T, dim]
        rope = self.rope[positions]  # [B, T, D/2, 2]
        mask = None if view is None else view.mask()  # [B, 1, T, S]
        for layer in self.layers:
            x = layer(x, rope, cache, view, mask)
        return self.output(self.norm(x))  # [B, T, vocab]

    @property
    def vocab_size(self) -> int:
        """Columns of the logits: the byte tokenizer's ids, padded to a multiple of 16."""
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        """The context: positions with a rotary angle and a KV cache entry."""
        return self.config.max_seq_len

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (the embeddings': an int8 variant quantizes only the linear
        layers, workers/variants.py)."""
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.tok_embeddings.weight.device

    @property
    def min_batch_rows(self) -> int:
        """4 in float32: from 4 rows on, MKL's float32 GEMMs give every row the same bits whatever
        the batch for all presets (measured for 1..64 rows; 2 rows differ). oneDNN's bfloat16 and
        float16 GEMMs measured invariant at every row count."""
        return 4 if self.dtype == torch.float32 else 1

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one held token takes."""
        c = self.config
        return PagedKVCache.bytes_per_token(c.n_layers, c.n_heads, c.head_dim, self.dtype)

    def new_cache(self, n_blocks: int) -> PagedKVCache:
        """An empty pool of `n_blocks` KV blocks on this model's device and dtype."""
        c = self.config
        return PagedKVCache(c.n_layers, c.n_heads, c.head_dim, n_blocks, self.device, self.dtype)

    def parameter_count(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters())

    def save(self, directory: Path) -> None:
        """Writes `model.safetensors` and `config.json` into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path, device: torch.device | str = "cpu") -> Transformer:
        """Reads weights saved by `save` (safetensors, never pickle) onto `device`."""
        return cls.from_checkpoint(directory, json.loads((directory / CONFIG_FILE).read_text()), device)

    @classmethod
    def from_checkpoint(
        cls,
        directory: Path,
        config_json: dict[str, Any],
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        max_len: int = 0,
    ) -> Transformer:
        """The model `config_json` (its `config.json`, read) describes, weights from `directory`
        cast to `dtype` (None: float32, as trained). Its context is its config's; `max_len` is
        taken for the loader's sake and the engine applies any lower cap."""
        config = ModelConfig.from_dict(config_json)
        with torch.device("meta"):
            model = cls(config)
        state = load_file(str(directory / WEIGHTS_FILE), device=str(device))
        if dtype is not None:
            state = {name: t.to(dtype) for name, t in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        model.rope = rope_table(config, torch.device(device))
        return model.eval()


def new_model(preset: str, seed: int) -> tuple[Transformer, ByteTokenizer]:
    """A model of the named preset, its weights freshly initialised from `seed`, and its tokenizer."""
    model = Transformer(ModelConfig.from_name(preset))
    init_weights(model, seed)
    return model, TOKENIZER


def init_weights(model: Transformer, seed: int) -> None:
    """Small normal init (std 0.02) for every linear and embedding weight, seeded."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
