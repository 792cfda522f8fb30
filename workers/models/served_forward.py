"""A served forward of the decoder (llama.py) on the CPU, layer by layer in direct calls: the same
kernels on the same tensors in the same order as its modules' forward, so the same bits, without
their per-call Python.

Why: at one row a step of SmolLM2-135M's int4 copy spent about a third of its time in Python around
its kernels (2 cores of an AMD EPYC: 10.4 ms a step through the modules, 6.8 with the same
kernels called in a flat loop). Per layer the modules make nine `nn.Module` calls, some 25 attribute
lookups through `nn.Module.__getattr__`, each norm and each attention call checks where it may run
and lays out the view's tensors again. Here the checks run once a forward (`serves`), the view's
arguments for the attention kernel are bound once (`native.bind_attention`), each norm writes
through the kernel directly and each layer's weights are looked up once. Where every product is
paired (a bfloat16 model on a CPU with AVX-512 BF16), or every one int8 in reflow's kernel (a
weight-only int8 copy of bfloat16 weights), all the layers run in one C++ call
(native.DecoderLayers): the same kernels, and torch's residual sums and silu(gate) x up computed as
torch computes them in bfloat16, so the same bits, with no Python and no interpreter's lock between
them (SmolLM2's bfloat16 token at one stream in process: 9.6-9.9 ms where it took 11.7 a layer at
a time, 2 cores of an AMD EPYC).

It runs where the worker's forwards run: on the CPU, with no gradient recorded, no step being
compiled, no adapter in the batch, the projections fused (`llama.fuse_projections`) and the native
kernel attending, for configs whose q and k are turned by halves in their own dtype with no per-head
norms (every Hugging Face config but Qwen3; the built-in model turns them in float32 pairs). Anything
else runs the modules' forward, as do fine-tunes and evaluations of adapters.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.models import native
from workers.models.kv_cache import CacheView, PagedKVCache

# A model here is a llama.LlamaForCausalLM and a norm its RMSNorm, named loosely: llama.py imports
# this module, and package modules import no cycle (even for type checking)
Model = Any
Norm = Any


def serves(model: Model, cache: PagedKVCache | None, view: CacheView | None) -> bool:
    """Whether `served_forward` computes this forward of `model`, with no adapter in it."""
    config = model.config
    return (
        cache is not None
        and view is not None
        and not config.qk_norm
        and not config.interleaved_rope
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and native.attends(cache.k)
        and model.model.layers[0].self_attn.qkv_proj is not None
        and model.model.layers[0].mlp.gate_up_proj is not None
    )


def served_forward(
    model: Model, tokens: Tensor, cache: PagedKVCache, view: CacheView, at: Tensor | None
) -> Tensor:
    """`model(tokens, cache, view, at=at)`'s logits, computed in direct calls (`serves` must be true)."""
    config = model.config
    b, t = tokens.shape
    x = F.embedding(tokens.reshape(-1), model.model.embed_tokens.weight)  # [N, dim]
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q_width, kv_width = heads * d, kv_heads * d
    token_stride = q_width + 2 * kv_width  # q, k and v lie side by side in each row of the product
    rope = model.rope[view.positions.reshape(-1)].to(x.dtype)  # [N, 2, D]: turned in their own dtype
    attend = native.bind_attention(
        cache.block_size, view.write.reshape(-1), view.read, view.positions.reshape(-1), view.starts,
        rope, (heads, kv_heads, d), config.sliding_window, d**-0.5, x.dtype, (token_stride,) * 3,
    )  # fmt: skip
    native_norms = native.normalizes(x, model.model.norm.weight)
    norm = _norm(native_norms)
    width = config.intermediate_size
    bound = _layers.get(model) or _layers.setdefault(model, _bind(model))
    if bound.one_call is not None and native_norms:  # every layer in one call, x in place
        bound.one_call(x, cache.k, cache.v, attend)
    else:
        for i, (input_norm, qkv_product, o_product, post_norm, gate_up_product, down_product) in enumerate(
            bound.calls
        ):
            qkv = qkv_product(norm(x, input_norm))
            q = qkv[:, :q_width].view(-1, heads, d)
            k = qkv[:, q_width : q_width + kv_width].view(-1, kv_heads, d)
            v = qkv[:, q_width + kv_width :].view(-1, kv_heads, d)
            x = x + o_product(attend(cache.k[i], cache.v[i], q, k, v).view(-1, q_width))
            gate_up = gate_up_product(norm(x, post_norm))
            x = x + down_product(F.silu(gate_up[:, :width]) * gate_up[:, width:])
    if at is not None:
        return model.lm_head(norm(x[at], model.model.norm))  # [N, V]
    return model.lm_head(norm(x, model.model.norm)).view(b, t, -1)  # [B, T, V]


def forget(model: nn.Module) -> None:
    """Drops what `served_forward` bound of `model`'s layers: called by `linears.replace_layer`,
    through which every change of a model's layout goes (packing, unpacking, quantizing), so that a
    forward never runs a layer the model no longer holds."""
    _layers.pop(model, None)


Product = Callable[[Tensor], Tensor]
# a layer's input norm, q/k/v product, output product, post-attention norm, gate/up and down products
LayerCalls = tuple[Norm, Product, Product, Norm, Product, Product]


@dataclass(frozen=True)
class BoundLayers:
    """A model's layers as `served_forward` runs them: each layer's calls, and where every product
    takes one of reflow's kernels (all paired, or all int8), all of them bound for one call
    (native.DecoderLayers) that runs them in C++."""

    calls: list[LayerCalls]
    one_call: native.DecoderLayers | None


_layers: weakref.WeakKeyDictionary[nn.Module, BoundLayers]
_layers = weakref.WeakKeyDictionary()  # by model; never copied with one: a copy binds its own


def _bind(model: Model) -> BoundLayers:
    """Each layer's norms and products as `served_forward` calls them, looked up once a model."""
    dtype = model.dtype
    layers = []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        products = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        qkv, o, gate_up, down = (_product(linear, dtype) for linear in products)
        layers.append((layer.input_layernorm, qkv, o, layer.post_attention_layernorm, gate_up, down))
    return BoundLayers(layers, _decoder_layers(model))


def _decoder_layers(model: Model) -> native.DecoderLayers | None:
    """`model`'s layers bound for decoder_layers.cpp where it runs them: bfloat16, an MLP as wide as
    a multiple of native.SILU_ROW (where its silu has torch's bits), and every product paired
    (`linears.PackedLinear`) or every one int8 in whole blocks of reflow's kernel (a weight-only
    copy's `precision.Int8Linear`); else None."""
    config, layers = model.config, model.model.layers
    products = [
        (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for layer in layers
    ]
    every = [linear for layer in products for linear in layer]
    paired = all(getattr(linear, "paired", False) for linear in every)
    int8 = all(getattr(linear, "whole_blocks", False) for linear in every)
    if model.dtype != torch.bfloat16 or config.intermediate_size % native.SILU_ROW or not (paired or int8):
        return None
    bound = []
    for layer, linears in zip(layers, products, strict=True):
        tensors = {
            "input_norm": layer.input_layernorm.weight.detach(),
            "post_norm": layer.post_attention_layernorm.weight.detach(),
        }
        for linear, name in zip(linears, native.PRODUCTS, strict=True):
            weights, scales = (linear.weight, linear.scales) if int8 else (linear.packed, None)
            tensors |= {name: weights, f"{name}_scales": scales, f"{name}_bias": linear.bias}
        bound.append(tensors)
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    sizes = (config.hidden_size, heads * d, kv_heads * d, config.intermediate_size)
    return native.bind_decoder_layers(bound, int8, sizes, config.rms_norm_eps)


def _product(linear: nn.Module | None, dtype: torch.dtype) -> Product:
    """What multiplies a forward's rows [N, in] of `dtype` by `linear` as its forward does: a
    weight-only copy's or a paired layer's kernel call itself where the rows go to it as they are
    (`row_product` of precision.py's and linears.py's layers), else the layer's forward."""
    assert linear is not None  # fused: `serves`
    row_product = getattr(linear, "row_product", None)
    return linear.forward if row_product is None else row_product(dtype)


def _norm(native_norms: bool) -> Callable[[Tensor, Norm], Tensor]:
    """How this forward normalises its rows (decided once): through the kernel where it normalises
    them (`native_norms`: `native.normalizes`), else by the norm's own forward (torch's operators)."""
    if not native_norms:
        return lambda rows, norm: norm(rows)
    write = native.rms_norm_into

    def normed(rows: Tensor, norm: Norm) -> Tensor:
        out = torch.empty_like(rows)
        write(rows, norm.weight, norm.eps, out)
        return out

    return normed
