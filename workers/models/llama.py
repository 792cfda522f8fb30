"""The one decoder: Llama-family models as Hugging Face checkpoints describe them (Llama 2/3/3.x,
SmolLM, TinyLlama, Mistral, Qwen2, Qwen3), and the built-in model, a preset of it (builtin.py).

Grouped-query attention with rotary positions (`rope_theta`, Llama 3 frequency scaling), SwiGLU,
RMSNorm, optional q/k/v biases (Qwen2) and per-head q/k norms (Qwen3), tied or separate output
embeddings, a sliding window (Mistral). Modules are named as transformers names them, so the
weights of `model.safetensors` (or its shards) load as they are, LoRA adapters apply by those
names, and the paged KV cache of `kv_cache.py` holds the keys and values. The math mirrors
transformers' modeling code operation for operation, so logits agree to float rounding and greedy
tokens are the same; the built-in model turns q and k as gpt-fast does, as it was trained.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from workers.models import native
from workers.models.kv_cache import CacheView, KeyMask, PagedKVCache, paged_attention
from workers.models.linears import StackedLinear, pack_linears, transpose_linears
from workers.models.lora import Adapter, AdapterRows, project, project_stacked
from workers.models.rotary import Rotation
from workers.models.served_forward import served_forward, serves

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # sharded checkpoints: tensor name -> file
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # config.json's model_type values read here
ROPE_TYPES = ("default", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # REFLOW_DTYPE


@dataclass(frozen=True)
class LlamaConfig:
    """What the model's shape and arithmetic depend on, read from `config.json` (or a preset's:
    builtin.py)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # llama3 frequency scaling, or None
    tie_word_embeddings: bool
    qkv_bias: bool  # the q, k and v projections carry a bias (Qwen2 always; others if configured)
    o_bias: bool  # the output projection does
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before rotation
    sliding_window: int  # 0 = attend to the whole sequence
    # q and k features turned in adjacent pairs (2i, 2i+1), in float32, as gpt-fast (and Meta's
    # first Llama) turn them: the built-in model's layout; else in halves (i, i+D/2), transformers'
    interleaved_rope: bool = False
    float32_batch_rows: int = 1  # `min_batch_rows` in float32, measured per shape family

    @classmethod
    def from_json(cls, config: dict[str, Any]) -> LlamaConfig:
        """Reads a config as transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)
        writes it; ValueError for what this file does not implement. The saved dtype (`torch_dtype`
        or `dtype`) does not matter: weights are cast to the served one."""
        model_type = config.get("model_type", "")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not implemented (only silu)")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not implemented ({', '.join(ROPE_TYPES)})")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        heads = config["num_attention_heads"]
        window = config.get("sliding_window") or 0
        if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
            window = 0  # Qwen configs carry a window they only use when asked
        return cls(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=model_type in ("llama", "qwen3") and bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(window),
        )


def auto_dtype(device: torch.device) -> torch.dtype:
    """REFLOW_DTYPE=auto: bfloat16 on CUDA (float16 where the GPU lacks it); float32 on the CPU,
    where it decodes faster than bfloat16 on the cores measured (docs/models.md)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def inverse_frequencies(config: LlamaConfig) -> Tensor:
    """Rotary inverse frequencies [D/2], Llama 3 scaling applied (transformers' rope init functions)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(config: LlamaConfig, length: int) -> Tensor:
    """cos and sin of every position's angles, float32: [length, 2, D], each frequency's angle at
    both features it turns (halves repeated, or pairs with `interleaved_rope`); sin carries the
    sign of the turn (`Rotation`): negative at the first of the two features."""
    angles = torch.outer(torch.arange(length).float(), inverse_frequencies(config))  # [S, D/2]
    sin = angles.sin()
    if config.interleaved_rope:
        angles = angles.repeat_interleave(2, dim=-1)  # [S, D]
        sin = torch.stack([-sin, sin], dim=-1).flatten(-2)
    else:
        angles = torch.cat([angles, angles], dim=-1)  # [S, D]
        sin = torch.cat([-sin, sin], dim=-1)
    return torch.stack([angles.cos(), sin], dim=1)


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalised in float32, scaled in the input's dtype; in one C++
    kernel where a served bfloat16 or float16 forward runs on the CPU (`native.normalizes`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if native.normalizes(x, self.weight):
            return native.rms_norm(x, self.weight, self.eps)
        # torch's kernel computes x * rsqrt(mean(x^2) + eps) as transformers' three steps do, bit
        # for bit, and in float32 for bfloat16 and float16 input, rounded once, as transformers'
        # cast to float32 and back does (checked on widths 64 to 4096, scales 0.01 to 30)
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention: H query heads share KVH key/value heads."""

    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.names = {
            p: f"model.layers.{layer}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )  # fmt: skip
        self.window = config.sliding_window
        self.scale = self.head_dim**-0.5  # as transformers passes it to attention
        bias = config.qkv_bias
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.qkv_proj: nn.Module | None = None  # q, k and v in one product (`fuse`)
        names = self.names
        self.qkv_parts = {names["q_proj"]: q_dim, names["k_proj"]: kv_dim, names["v_proj"]: kv_dim}

    def fuse(self) -> None:
        """Computes q, k and v in one product instead of three: their weights stacked in `qkv_proj`,
        the three removed (once; a fused model is served, never saved)."""
        if self.qkv_proj is None:
            self.qkv_proj = StackedLinear.stack(
                {self.names[p]: getattr(self, p) for p in ("q_proj", "k_proj", "v_proj")}
            )
            del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: Tensor,
        rotation: Rotation,
        cache: PagedKVCache | None,
        view: CacheView | None,
        mask: KeyMask | None,
        adapters: AdapterRows | None,
    ) -> Tensor:
        b, t, _ = x.shape
        names = self.names
        if self.qkv_proj is not None:
            q, k, v = project_stacked(self.qkv_proj, x, adapters, self.qkv_parts)
        else:
            q = project(self.q_proj, x, adapters, names["q_proj"])
            k = project(self.k_proj, x, adapters, names["k_proj"])
            v = project(self.v_proj, x, adapters, names["v_proj"])
        q = q.view(b, t, self.heads, self.head_dim)  # [B, T, H, D]
        k, v = k.view(b, t, self.kv_heads, self.head_dim), v.view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is None or view is None:  # training: one causal pass over whole rows
            q, k = rotation(q), rotation(k)  # [B, T, heads, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
            window = None
            if self.window:
                positions = torch.arange(t, device=x.device)
                window = (positions[None, :] <= positions[:, None]) & (
                    positions[None, :] > positions[:, None] - self.window
                )  # [T, T]
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=window, is_causal=window is None, scale=self.scale, enable_gqa=True
            )
        else:
            y = paged_attention(cache, self.layer, view, q, k, v, mask, rotation, self.window, self.scale)
        y = y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return project(self.o_proj, y, adapters, names["o_proj"])  # [B, T, dim]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.names = {p: f"model.layers.{layer}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one product (`fuse`)
        width = config.intermediate_size
        self.gate_up_parts = {self.names["gate_proj"]: width, self.names["up_proj"]: width}

    def fuse(self) -> None:
        """Computes gate and up in one product instead of two (as `Attention.fuse`)."""
        if self.gate_up_proj is None:
            self.gate_up_proj = StackedLinear.stack(
                {self.names[p]: getattr(self, p) for p in ("gate_proj", "up_proj")}
            )
            del self.gate_proj, self.up_proj

    def forward(self, x: Tensor, adapters: AdapterRows | None) -> Tensor:
        names = self.names
        if self.gate_up_proj is not None:
            gate, up = project_stacked(self.gate_up_proj, x, adapters, self.gate_up_parts)
        else:
            gate = project(self.gate_proj, x, adapters, names["gate_proj"])
            up = project(self.up_proj, x, adapters, names["up_proj"])
        return project(self.down_proj, F.silu(gate) * up, adapters, names["down_proj"])


def fuse_projections(model: nn.Module) -> None:
    """Fuses every layer's q/k/v and gate/up products (`Attention.fuse`, `MLP.fuse`), in place:
    how a worker serves a model. Its logits are the same bits (each output channel the same
    product), adapters apply to each part by its name, and it is never saved."""
    for module in model.modules():
        if isinstance(module, Attention | MLP):
            module.fuse()


def serving_layout(model: nn.Module) -> None:
    """Lays `model` out as a worker serves it, in place: q/k/v and gate/up fused
    (`fuse_projections`), then bfloat16 weights packed for this CPU (`linears.pack_linears`) and
    float32 weights transposed where that multiplies faster here (`linears.transpose_linears`). Its
    logits are the model's as loaded, up to the rounding of those products; it is never saved."""
    fuse_projections(model)
    pack_linears(model)
    transpose_linears(model)


def is_fused(model: nn.Module) -> bool:
    """Whether `fuse_projections` fused `model`."""
    return any(isinstance(module, Attention) and module.qkv_proj is not None for module in model.modules())


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then MLP, each around a residual."""

    def __init__(self, config: LlamaConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        rotation: Rotation,
        cache: PagedKVCache | None,
        view: CacheView | None,
        mask: KeyMask | None,
        adapters: AdapterRows | None,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotation, cache, view, mask, adapters)
        return x + self.mlp(self.post_attention_layernorm(x), adapters)


class Decoder(nn.Module):
    """Embeddings, layers and the final norm: transformers' `model.` prefix."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Checkpoint(Protocol):
    """The files a decoder was read from, which it is saved as."""

    def write(self, state: dict[str, Tensor], dtype: torch.dtype, directory: Path) -> None:
        """Writes `state` (the decoder's weights under its own names, on the CPU, in `dtype`) and
        `config.json` into `directory`."""
        ...


@dataclass(frozen=True)
class HFCheckpoint:
    """transformers' files: the weights under the decoder's own names, `config.json` as read."""

    config_json: dict[str, Any]

    def write(self, state: dict[str, Tensor], dtype: torch.dtype, directory: Path) -> None:
        """Writes `model.safetensors` and `config.json` with the weights' dtype as `torch_dtype`."""
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        config = {**self.config_json, "torch_dtype": str(dtype).removeprefix("torch.")}
        config.pop("dtype", None)
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM behind reflow's `CausalLM` seam, seen through a LoRA adapter once
    `adapted`."""

    rope: Tensor  # a buffer: [max_seq_len, 2, D] float32

    def __init__(self, config: LlamaConfig, checkpoint: Checkpoint, max_len: int = 0):
        super().__init__()
        self.config = config
        self.checkpoint = checkpoint  # the files it was read from: saved back as they are
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.adapter: Adapter | None = None  # set by `adapted`
        self._max_len = min(max_len or config.max_position_embeddings, config.max_position_embeddings)
        self.register_buffer("rope", rope_table(config, self._max_len), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> LlamaForCausalLM:
        """What `to`, `bfloat16` and the like apply to every tensor, except that the rotary table
        keeps its float32 values, as a model loaded in the new dtype holds it (`load_weights`): a
        variant is its reference cast so (`precision.in_precision`)."""
        rope = self.rope
        super()._apply(fn, recurse)
        self.rope = rope.to(self.rope.device)  # where `fn` put it, its float32 values as they were
        return self

    def forward(
        self,
        tokens: Tensor,
        cache: PagedKVCache | None = None,
        view: CacheView | None = None,
        adapters: AdapterRows | None = None,
        at: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, T, V] of tokens [B, T]: causal over whole rows without a cache, else the
        tokens placed in the cache where `view` says; each row through its adapter, if any (an
        adapted model's: its own). With `at` ([N] indices of tokens among the B*T, row by row),
        those tokens' alone: [N, V]."""
        b, t = tokens.shape
        if self.adapter is not None:
            if adapters is not None:
                raise ValueError("an adapted model applies its own adapter only")
            adapters = self.adapter.rows(b)
        if adapters is None and serves(self, cache, view):
            assert cache is not None and view is not None
            return served_forward(self, tokens, cache, view, at)  # the same bits, less Python
        positions = view.positions if view is not None else torch.arange(t, device=tokens.device).expand(b, t)
        x = self.model.embed_tokens(tokens)  # [B, T, dim]
        rope = self.rope[positions]  # [B, T, 2, D] float32
        if not self.config.interleaved_rope:
            rope = rope.to(x.dtype)  # transformers turns q and k in their own dtype
        rotation = Rotation.of(rope, self.config.interleaved_rope)
        mask = None if view is None or view.packed else view.mask(self.config.sliding_window)
        for layer in self.model.layers:
            x = layer(x, rotation, cache, view, mask, adapters)
        if at is not None:
            x = x.flatten(0, 1)[at]  # [N, dim]
        return self.lm_head(self.model.norm(x))  # [B, T, V] or [N, V]

    @property
    def model_type(self) -> str:
        """config.json's model_type (`reflow` for the built-in model)."""
        return self.config.model_type

    @property
    def vocab_size(self) -> int:
        """Columns of the logits (config.json's vocab_size)."""
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        """The model's context, or less when the server caps it."""
        return self._max_len

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the weights are served in (the embeddings': an int8 or int4 variant quantizes
        only the linear layers, workers/models/precision.py)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.model.embed_tokens.weight.device

    @property
    def min_batch_rows(self) -> int:
        """The config's `float32_batch_rows` in float32: 4 for the built-in presets, from which on
        MKL's float32 GEMMs give every row the same bits whatever the batch (measured for 1..64
        rows; 2 rows differ); 1 for Hugging Face shapes, where MKL's kernel choice changes at row
        counts padding cannot avoid (below 16 rows and, for a 576x1536 projection, between 57 and
        ~200), so padding would only cost. 1 in bfloat16 and float16: each of oneDNN's packed
        products pads itself as its shape needs (workers/models/linears.py)."""
        return self.config.float32_batch_rows if self.dtype == torch.float32 else 1

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one held token takes."""
        c = self.config
        layers, kv_heads = c.num_hidden_layers, c.num_key_value_heads
        return PagedKVCache.bytes_per_token(layers, kv_heads, c.head_dim, self.dtype)

    def new_cache(self, n_blocks: int) -> PagedKVCache:
        """An empty pool of `n_blocks` KV blocks on this model's device and dtype."""
        c = self.config
        return PagedKVCache(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, n_blocks, self.device, self.dtype
        )

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Its weights, or an adapted model's adapter tensors: all it trains."""
        if self.adapter is not None:
            return iter(self.adapter.parameters())  # type: ignore[arg-type]  # leaf tensors with grads
        return super().parameters(recurse)

    def parameter_count(self) -> int:
        """Number of weights it trains (tied embeddings counted once)."""
        return sum(p.numel() for p in self.parameters())

    def adapted(self, adapter: Adapter) -> LlamaForCausalLM:
        """This model's weights, frozen and shared, seen through `adapter` (in place of its own
        adapter, if it has one): what a LoRA fine-tune trains, judges and saves."""
        adapter.check(self)
        with torch.device("meta"):
            view = LlamaForCausalLM(self.config, self.checkpoint, self._max_len)
        view.model, view.lm_head, view.rope = self.model, self.lm_head, self.rope
        view.model.requires_grad_(False)  # the champion's weights
        view.lm_head.requires_grad_(False)
        view.adapter = adapter
        return view

    def save(self, directory: Path) -> None:
        """Writes its weights as its checkpoint's files hold them, or an adapted model's adapter
        alone, in PEFT's format (the weights it adapts are registered already)."""
        if self.adapter is not None:
            self.adapter.save(directory, base_model="")
            return
        if is_fused(self):
            raise ValueError("a model fused for serving is not saved: save the model as loaded")
        directory.mkdir(parents=True, exist_ok=True)
        state = {n: t.detach().contiguous().cpu() for n, t in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            del state["lm_head.weight"]  # transformers leaves the tied copy out
        self.checkpoint.write(state, self.dtype, directory)

    def load_weights(self, state: dict[str, Tensor]) -> LlamaForCausalLM:
        """This model, built on the meta device, with `state` (the decoder's names) as its weights,
        on their device and in their dtype; in inference mode."""
        if self.config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        self.load_state_dict(state, strict=True, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one parameter, as trained
        self.rope = rope_table(self.config, self.max_seq_len).to(self.device)
        return self.eval()

    @classmethod
    def from_checkpoint(
        cls,
        directory: Path,
        config_json: dict[str, Any],
        device: torch.device,
        dtype: torch.dtype | None = None,
        max_len: int = 0,
    ) -> LlamaForCausalLM:
        """The model `config_json` describes with the weights of `directory` (safetensors, one
        file or shards), cast to `dtype` (None: `auto_dtype`) on `device`, its context capped at
        `max_len`."""
        model = cls.skeleton(directory, config_json, max_len)
        return model.load_weights(read_weights(directory, device, dtype or auto_dtype(device)))

    @classmethod
    def skeleton(cls, directory: Path, config_json: dict[str, Any], max_len: int = 0) -> LlamaForCausalLM:
        """The model on the meta device (no memory), once its config and the names in its weight
        files' headers are known to match; ValueError saying how they differ."""
        config = LlamaConfig.from_json(config_json)
        with torch.device("meta"):
            model = cls(config, HFCheckpoint(config_json), max_len)
        names = {n for file in weight_files(directory) for n in _tensor_names(file)}
        if config.tie_word_embeddings:
            names.add("lm_head.weight")
        expected = set(model.state_dict())
        missing, unexpected = expected - names, names - expected
        if missing or unexpected:
            raise ValueError(
                f"{directory} does not match its config.json: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        return model


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, else `model.safetensors`."""
    index = directory / WEIGHTS_INDEX_FILE
    if index.is_file():
        return [directory / name for name in shard_names(index)]
    return [directory / WEIGHTS_FILE]


def shard_names(index: Path) -> list[str]:
    """The shard files `model.safetensors.index.json` maps tensors to, sorted; ValueError for an
    index that is not one, or that names anything but a `*.safetensors` file beside it (a path, `..`)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # not JSON, no map, not a map
        raise ValueError(f"{index} is not a weight index ({type(error).__name__}: {error})") from None
    for name in names:
        if not (isinstance(name, str) and name.endswith(".safetensors")) or ".." in name or "/" in name:
            raise ValueError(
                f"{index} maps tensors to {name!r}; a shard is a *.safetensors file in the checkpoint "
                "directory, named without a path"
            )
    return names


def _tensor_names(file: Path) -> list[str]:
    """The tensors a safetensors file holds (its header only), less buffers older transformers saved;
    ValueError naming a file that is no safetensors file (truncated, or something else)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return [n for n in f.keys() if not n.endswith("rotary_emb.inv_freq")]  # noqa: SIM118
    except SafetensorError as error:
        raise ValueError(f"{file.name} is not a readable safetensors file ({error})") from None


class StoredWeights:
    """A checkpoint's weights as its safetensors files store them (never a pickle), each read on the
    CPU in float32 when asked: what a quantized copy of a version held in fewer bits is quantized
    from (workers/variants.py), one layer's at a time."""

    def __init__(self, directory: Path):
        self.opened: dict[str, safe_open] = {}  # tensor name -> its file, mapped once, until dropped
        for file in weight_files(directory):
            self.opened.update(dict.fromkeys(_tensor_names(file), safe_open(str(file), framework="pt")))

    def read(self, name: str) -> Tensor:
        """The tensor the decoder names `name`; a tied output head's is the embeddings' (a checkpoint
        that stores no head loaded only where its config ties it: `skeleton`)."""
        if name == "lm_head.weight" and name not in self.opened:
            name = "model.embed_tokens.weight"
        return self.opened[name].get_tensor(name).float()


def read_weights(directory: Path, device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """Every tensor of the checkpoint's safetensors files (never a pickle), cast to `dtype`."""
    state: dict[str, Tensor] = {}
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in _tensor_names(file):
                state[name] = f.get_tensor(name).to(dtype)
    return state
