"""A model's weights in another precision: how a version's variants (workers/variants.py) are made,
and how the fine-tune job scores them on its task before they are ever served.

`int8` and `int4` are weight-only quantizations of every linear layer, the output head included
(gpt-fast's recipe): the weights are stored in 8 or 4 bits, and each product runs on bfloat16
activations in a CPU kernel for such weights (int8: reflow's own, `native.int8_linear`, where it
builds; int4: torch's `_weight_int4pack_mm_for_cpu`). They are quantized from float32 weights
where the version has them (a bfloat16 version's from its checkpoint: `in_precision`'s `stored`),
and everything else (embeddings, norms, attention, the KV cache) is held in bfloat16, whatever the
version's dtype: each product's rows then go to its kernel as they are, and an int8 copy's layers
run in one call (`native.DecoderLayers`). So computed, SmolLM2-135M's int8 copy of float32
weights agreed with float32 on as many tokens as with the rest in float32 (docs/models.md), and on 2
cores of an Ice Lake Xeon, which has no bfloat16 instructions and where `auto` serves float32, it
served one stream in 10.7-15.4 ms a token against 24.0-26.3 with the rest in float32. A copy's
q/k/v and gate/up projections are fused before they are quantized, as every served copy's are
(`llama.fuse_projections`): four products a layer instead of seven, the same bits (per output
channel the same quantized weights and kernel), 7% less time a decode step of SmolLM2 at batch 1 in
int4 and within the noise at 16 (benchmarks/fusion.py).

- `int8`: symmetric, one scale per native.INT8_GROUP (32) inputs of each output channel (absmax /
  127, as llama.cpp's Q8_0).
- `int4`: asymmetric, a scale and a zero point per GROUP_SIZE inputs of each output channel. The
  output head is held in int8: its scores rank the next token among the whole vocabulary, and in 4
  bits they rank it wrong too often (SmolLM2-135M's teacher-forced token agreement with float32 on
  benchmarks/variants.py's 16 prompts x 32 tokens: 0.873 with an int4 head, 0.973 with an int8 one;
  int8 throughout: 0.965).
  So is a layer whose shapes the kernel does not take (out_features not a multiple of 16,
  in_features not one of GROUP_SIZE).

Weight-only kernels read a quarter or an eighth of float32's bytes, which is what a decode step is
bound by. Measured on 2 cores of an AMD EPYC without AMX, one row through SmolLM2-135M's 576->1536
projection took 72 us in float32, 33 in int8 and 28 in int4; its 49152-wide head 10.5 ms, 2.7 and
0.8 (torch's kernels; `_weight_int8pack_mm` on float32 activations took 469 us: hence bfloat16).
Each row's result is the same in any batch, so a variant's outputs do not depend on its
neighbours. The kernels are the CPU's. `bfloat16` and `float16` are casts of every weight. The same
weights always give the same variant.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.models import native
from workers.models.interface import CausalLM
from workers.models.linears import StackedLinear, replace_layer, unpacked_copy
from workers.models.llama import StoredWeights, fuse_projections

QUANTIZED = ("int8", "int4")  # the weight-only precisions; the others are float dtypes' names
GROUP_SIZE = 32  # int4: inputs per scale and zero point (gpt-fast's smallest; smaller keeps more)
INT4_ROWS = 16  # int4: out_features must be a multiple of this for the kernel's packing
ACTIVATIONS = torch.bfloat16  # what the weight-only kernels multiply


def in_precision(model: CausalLM, name: str, stored: StoredWeights | None = None) -> CausalLM:
    """A copy of `model` with its weights in `name` (`int8`, `int4`, or a float dtype's name); a
    quantized one quantized from `stored` (`model`'s checkpoint as its files hold it) where given,
    else from the weights as loaded."""
    copied: CausalLM = unpacked_copy(model)  # type: ignore[arg-type,assignment]  # an nn.Module
    if name in QUANTIZED:  # the rest in bfloat16
        module: nn.Module = copied  # type: ignore[assignment]  # a CausalLM is an nn.Module
        fuse_projections(module)  # q/k/v and gate/up in one product each, quantized as one
        quantize_linears(module, name, model.vocab_size, stored)
    return copied.to(ACTIVATIONS if name in QUANTIZED else getattr(torch, name))  # type: ignore[attr-defined]


def quantize_linears(
    module: nn.Module, name: str, vocab_size: int, stored: StoredWeights | None = None
) -> None:
    """Replaces every linear layer of `module` by its weights in `name`, the output head (the layer
    `vocab_size` wide) in int8: each quantized from its weights in `stored` where given."""
    for path, linear in [(p, m) for p, m in module.named_modules() if isinstance(m, nn.Linear)]:
        head = linear.out_features == vocab_size
        weight = None if stored is None else stored_weight(stored, path, linear)
        replace_layer(module, path, quantized(linear, "int8" if head else name, weight))


def stored_weight(stored: StoredWeights, path: str, linear: nn.Linear) -> Tensor:
    """The weight of `linear` (at `path` in its model, which was loaded from `stored`'s files) as
    `stored` holds it: a stacked layer's parts' stacked (`fuse_projections`)."""
    parts = linear.parts if isinstance(linear, StackedLinear) else {path: linear.out_features}
    return torch.cat([stored.read(f"{part}.weight") for part in parts])


def quantized(linear: nn.Linear, name: str, weight: Tensor | None = None) -> nn.Module:
    """`linear` with its weights (`weight` where given, of its shape) in `name` (int8, or int4
    where its shapes allow)."""
    if name == "int4" and linear.out_features % INT4_ROWS == 0 and linear.in_features % GROUP_SIZE == 0:
        return Int4Linear(linear, weight)
    return Int8Linear(linear, weight)


class WeightOnlyLinear(nn.Module, abc.ABC):
    """A linear layer whose weights are held quantized: `y = x W^T + b`, the product computed on
    bfloat16 activations and returned in the input's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias: Tensor | None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    @staticmethod
    def source(linear: nn.Linear, weight: Tensor | None) -> Tensor:
        """What a layer is quantized from, in float32: `weight` (of `linear`'s shape) where given,
        else `linear`'s own."""
        return (linear.weight if weight is None else weight).detach().float()

    def forward(self, x: Tensor) -> Tensor:
        # bfloat16 activations (every copy's: in_precision) go to the kernel as they are: at one row
        # the casts' and copies' calls cost a sixth of a small product (4.5 us against 29 at 576x1536)
        same = x.dtype == ACTIVATIONS
        if same and x.is_contiguous():
            rows = x.view(-1, self.in_features)
        else:
            rows = x.reshape(-1, self.in_features).to(ACTIVATIONS).contiguous()
        y = self.product(rows).view(*x.shape[:-1], self.out_features)
        y = y if same else y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def row_product(self, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        """What multiplies contiguous rows [N, in_features] of `dtype` by this layer as `forward`
        does, in fewer calls: the kernel's own where the rows go to it as they are (a served
        forward's, workers/models/served_forward.py)."""
        return self.product if dtype == ACTIVATIONS and self.bias is None else self.forward

    @abc.abstractmethod
    def product(self, rows: Tensor) -> Tensor:
        """x W^T of bfloat16 rows [N, in_features], by the layer's kernel."""


class Int8Linear(WeightOnlyLinear):
    """Weights int8, one symmetric scale per native.INT8_GROUP inputs of each output channel, laid
    out for reflow's kernel (`native.blocks_of`, with zero channels up to a multiple of
    native.INT8_BLOCK) and multiplied by it where it builds (`native.int8_linear`): it reads the
    weights front to back and took SmolLM2's layers at one row in 0.38-0.87x the time of torch's
    `_weight_int8pack_mm` (one scale a channel), 0.33-0.83x at 16 and 64 rows. Else, and in a
    forward autograd records or a step being compiled, torch multiplies the weights times their
    scales in bfloat16 (`dequantized`)."""

    weight: Tensor  # int8 [channels / 16, in, 16]
    scales: Tensor  # bfloat16 [channels / 16, groups, 16]

    def __init__(self, linear: nn.Linear, weight: Tensor | None = None):
        super().__init__(linear)
        groups = -(-self.in_features // native.INT8_GROUP)
        weight = F.pad(self.source(linear, weight), (0, groups * native.INT8_GROUP - self.in_features))
        weight = weight.view(self.out_features, groups, native.INT8_GROUP)
        scales = (weight.abs().amax(dim=-1).clamp(min=1e-12) / 127).to(ACTIVATIONS)  # [out, groups]
        q = torch.round(weight / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
        q = q.view(self.out_features, -1)[:, : self.in_features]
        padded = -self.out_features % native.INT8_BLOCK  # zero channels, whose outputs are dropped
        self.register_buffer("weight", native.blocks_of(F.pad(q, (0, 0, 0, padded))))
        self.register_buffer("scales", native.blocks_of(F.pad(scales, (0, 0, 0, padded))))

    @property
    def whole_blocks(self) -> bool:
        """Whether its outputs fill whole blocks, no zero channels padded: what a served forward's
        one call of the layers takes."""
        return len(self.weight) * native.INT8_BLOCK == self.out_features

    def product(self, rows: Tensor) -> Tensor:
        if not native.multiplies_int8(rows):
            return F.linear(rows, self.dequantized())
        y = native.int8_linear(rows, self.weight, self.scales)
        return y if self.whole_blocks else y[:, : self.out_features].contiguous()

    def dequantized(self) -> Tensor:
        """The weights [out, in] times their scales, in bfloat16."""
        q = native.unblocked(self.weight)[: self.out_features].float()
        scales = native.unblocked(self.scales)[: self.out_features].float()
        scales = scales.repeat_interleave(native.INT8_GROUP, dim=1)[:, : self.in_features]
        return (q * scales).to(ACTIVATIONS)


class Int4Linear(WeightOnlyLinear):
    """Weights in 4 bits, a scale and a zero point per GROUP_SIZE inputs of each output channel:
    w ≈ (q - 8) · scale + zero, q in 0..15, packed for the CPU kernel."""

    weight: Tensor  # packed
    scales_and_zeros: Tensor  # [in / G, out, 2]

    def __init__(self, linear: nn.Linear, weight: Tensor | None = None):
        super().__init__(linear)
        groups = self.source(linear, weight).reshape(self.out_features, -1, GROUP_SIZE)  # [out, in / G, G]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-6)
        zeros = low + scales * 8
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(self.out_features, -1), 1)
        self.register_buffer("weight", packed)
        scales_and_zeros = torch.stack([scales, zeros], -1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(ACTIVATIONS))

    def product(self, rows: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.weight, GROUP_SIZE, self.scales_and_zeros)
