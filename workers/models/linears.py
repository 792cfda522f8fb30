"""The linear layers a served model computes with besides nn.Linear: several layers that read one
input stacked into one product (`StackedLinear`), bfloat16 weights packed once for this CPU's
oneDNN kernels or reflow's own (`PackedLinear`), and float32 weights stored transposed
(`transpose_linears`).

Packing: a bfloat16 product through `torch.nn.functional.linear` on the CPU goes to oneDNN, which
reorders the whole weight into its blocked layout on every call. `PackedLinear` holds the weight in
that layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing does), so a
product reads it once. Measured on 2 cores of a Xeon with AMX (torch 2.13), SmolLM2-135M's 576->3072
gate/up product took 179 / 162 / 268 us at 1 / 16 / 64 rows plain and 68 / 72 / 150 packed; its
49152-wide head 1.85 / 1.99 / 3.45 ms plain and 1.28 / 1.40 / 2.28 packed.

The layout is the one oneDNN picks for one row (`_reorder_linear_weight(w, 1)`): with it every row
count ran the same kernel on that Xeon, so each row came out with the same bits in any batch (with
the layouts picked for 16 or 64 rows, a row's bits changed between 5 and 32 rows, as they do
unpacked on that CPU). A product over more than ROW_CHUNK rows (a long prefill) runs in chunks of
ROW_CHUNK: from about 150 rows oneDNN splits the inner dimension of a 1536-wide input between the
threads, and a split sum rounds differently. On an AMD EPYC without AMX, a 1536-wide input's single
row rounds differently from the same row among others (at one thread as at two), and from two rows on
every row kept its bits: such a shape's products are padded to two rows. How many rows each shape
needs on this CPU is measured once per shape (`rows_for_same_bits`), at every row count up to
ROW_CHUNK against each row alone, on rows that show any change in the order of a sum
(`order_probe`); a shape that needs more than MAX_PADDED_ROWS is left unpacked
(docs/batching.md#exactness).

Pairs: on a CPU with AVX-512 BF16, reflow's own kernel (`native.bind_paired`) multiplies a
weight laid out in pairs of inputs, each output summed in one order at any row count, so it needs
no padding to keep a row's bits. On 2 cores of an AMD EPYC with AVX-512 BF16 (no AMX) a decode
step of SmolLM2 took 0.76x the time with every layer but the head in pairs at one row, 0.78x at 16
and 0.85x at 64; where AMX multiplies a batch, oneDNN's products are likely faster. So it is
measured once per shape (`paired_is_faster`), and a layer takes the pairs where they are faster
over TIMED_ROWS.

Transposing: a float32 product goes to MKL's sgemm, whose speed at a few rows depends on how the
weight lies in memory. On 2 cores of an Intel Xeon without AVX-512 BF16 (Ice Lake, torch 2.13),
SmolLM2-135M's layers' products with their [out, in] weights took 118 ms a step at 16 rows, as at 64,
and 53 ms with each weight stored [in, out] (a transposed view of it, the same values and shape):
0.89x the time at 1 row, 0.56x at 4, 0.45x at 16, 0.93x at 64, but 1.26x at 2 and 3 rows. Which
layout is faster depends on the CPU, so it is measured once per shape (`transposed_is_faster`), and
a layer's weight is transposed where that is faster over TIMED_ROWS. The sums are MKL's either way;
their rounding may differ between the layouts, as it differs between row counts in either.
"""

from __future__ import annotations

import copy
import functools
import statistics
import time
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.models import native, served_forward

PACKED_DTYPE = torch.bfloat16  # the weights oneDNN's packed products take here
ROW_CHUNK = 128  # most rows in one packed product: longer inputs run in chunks of this many
MAX_PADDED_ROWS = 8  # most rows a packed product is padded to; a shape needing more stays unpacked
TRANSPOSED_DTYPE = torch.float32  # the weights whose layout MKL's products are timed in
TIMED_ROWS = (1, 2, 4, 16)  # the row counts both layouts are timed at: one stream, a few, a batch
# each time is the least of this many products, after one to warm up: on a shared 2-core machine a
# few products of any layout take milliseconds more (a thread descheduled), and a median of 9 once
# timed a 576->3072 product's layouts alike at every row count where their least times were 4x apart
TIMED_PRODUCTS = 15
MIN_SPEEDUP = 1.1  # how much faster (the geometric mean over TIMED_ROWS) a layout must be to be taken


class StackedLinear(nn.Linear):
    """Linear layers that read one input, computed as one: their weights (and biases) stacked, one
    product instead of several, each part still adapted under its own name
    (`lora.project_stacked`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, parts: Mapping[str, int]):
        with torch.device("meta"):  # no memory and no initialisation: the weights are given
            super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None)
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=bias.requires_grad)
        self.parts = dict(parts)  # full name -> width, in the order they are stacked

    @classmethod
    def stack(cls, parts: Mapping[str, nn.Linear]) -> StackedLinear:
        """The layers `parts` (full name -> layer, all reading one input) as one."""
        linears = list(parts.values())
        with torch.no_grad():
            weights: list[Tensor] = [linear.weight for linear in linears]
            weight = torch.cat(weights)
            biases: list[Tensor] = [linear.bias for linear in linears if linear.bias is not None]
            bias = torch.cat(biases) if biases else None
        stacked = cls(weight, bias, {name: linear.out_features for name, linear in parts.items()})
        return stacked.requires_grad_(linears[0].weight.requires_grad)


class PackedLinear(nn.Module):
    """A bfloat16 linear layer (or a `StackedLinear`, whose `parts` it keeps) with its weight packed
    for this CPU: for oneDNN's products, or in pairs for reflow's own (`paired`); served, never
    trained or saved."""

    bias: Tensor | None

    def __init__(self, linear: nn.Linear, min_rows: int = 1, paired: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.parts = dict(linear.parts) if isinstance(linear, StackedLinear) else {}
        weight = linear.weight.detach()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.paired = paired
        if paired:
            self.packed = native.pairs_of(weight)
            self.product = native.bind_paired(self.packed, self.bias)  # contiguous rows [N, in]
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # no .to()
        self.min_rows = min_rows  # fewer rows are padded to this many (`rows_for_same_bits`)

    def forward(self, x: Tensor) -> Tensor:
        if self.paired:
            rows = x.reshape(-1, self.in_features).contiguous()
            return self.product(rows).view(*x.shape[:-1], self.out_features)
        count = x.numel() // self.in_features
        if self.min_rows <= count <= ROW_CHUNK:  # a decode step's rows: one product, of x as it is
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        if count <= ROW_CHUNK:
            y = self._product(rows)
        else:
            y = torch.cat([self._product(chunk) for chunk in rows.split(ROW_CHUNK)])
        return y.view(*x.shape[:-1], self.out_features)

    def _product(self, rows: Tensor) -> Tensor:
        """At most ROW_CHUNK rows' product, padded with zero rows to `min_rows`."""
        short = self.min_rows - len(rows)
        if short > 0:
            rows = torch.cat([rows, rows.new_zeros(short, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y[: len(y) - short] if short > 0 else y

    def row_product(self, dtype: torch.dtype) -> Callable[[Tensor], Tensor]:
        """What multiplies contiguous rows [N, in_features] of `dtype` by this layer as `forward`
        does, in fewer calls: the product bound to the pairs where they are (a served forward's,
        workers/models/served_forward.py)."""
        return self.product if self.paired and dtype == PACKED_DTYPE else self.forward

    def unpacked(self) -> nn.Linear:
        """The layer it was packed from: the weight back in its plain layout (the same values)."""
        weight = native.unpaired(self.packed) if self.paired else self.packed.to_dense()
        bias = None if self.bias is None else self.bias.clone()
        if self.parts:
            return StackedLinear(weight, bias, self.parts)
        return plain_linear(weight, bias)


def packs(model: nn.Module) -> bool:
    """Whether `pack_linears` packs `model`'s layers: bfloat16 weights on a CPU that oneDNN
    multiplies bfloat16 on."""
    weight = next(model.parameters())
    return (
        weight.dtype == PACKED_DTYPE
        and weight.device.type == "cpu"
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def pack_linears(model: nn.Module, pairs: bool = True) -> None:
    """Replaces each linear layer of `model` by a `PackedLinear`, in place, where `packs(model)`: in
    pairs where that multiplies faster here (`paired_is_faster`) and `pairs` allows it, else for
    oneDNN where its shape keeps its rows' bits, padded to as many rows as that takes
    (`rows_for_same_bits`). A tied output head gets a packed copy of its own (the embeddings keep
    theirs). Without `pairs`, bfloat16 is laid out as it was before them (benchmarks/weight_layouts.py)."""
    if not packs(model):
        return
    for path, linear in [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]:
        if pairs and paired_is_faster(linear.in_features, linear.out_features):
            replace_layer(model, path, PackedLinear(linear, paired=True))
            continue
        min_rows = rows_for_same_bits(linear.in_features, linear.out_features, linear.bias is not None)
        if min_rows is not None:
            replace_layer(model, path, PackedLinear(linear, min_rows))


def unpack_linears(model: nn.Module) -> None:
    """Replaces each `PackedLinear` of `model` by the layer it was packed from, in place: what a
    compiled step multiplies, since inductor lowers a packed product only over weights it packed
    itself when freezing them (which a served model never is: its weights change in place)."""
    for path, layer in [(p, m) for p, m in model.named_modules() if isinstance(m, PackedLinear)]:
        replace_layer(model, path, layer.unpacked())


def replace_layer(model: nn.Module, path: str, layer: nn.Module) -> None:
    """Puts `layer` in `model` at `path` (a submodule's full name), in place of what is there."""
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)
    served_forward.forget(model)


def unpacked_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with each `PackedLinear` back as the layer it was packed from (a
    packed weight does not copy) and each transposed weight back in its plain layout."""
    memo = {id(m): m.unpacked() for m in model.modules() if isinstance(m, PackedLinear)}
    copied: nn.Module = copy.deepcopy(model, memo)
    for linear in copied.modules():
        if isinstance(linear, nn.Linear) and not linear.weight.is_contiguous():
            linear.weight = nn.Parameter(linear.weight.detach().contiguous(), linear.weight.requires_grad)
    return copied


def transposes(model: nn.Module) -> bool:
    """Whether `transpose_linears` may transpose `model`'s weights: float32 weights on the CPU."""
    weight = next(model.parameters())
    return weight.dtype == TRANSPOSED_DTYPE and weight.device.type == "cpu"


def transpose_linears(model: nn.Module) -> None:
    """Stores the weight of each linear layer of `model` whose shape multiplies faster that way on
    this CPU (`transposed_is_faster`) transposed in memory, in place, where `transposes(model)`:
    an [out, in] view of an [in, out] tensor, the same values and shape. A tied output head gets a
    transposed copy of its own (the embeddings keep theirs)."""
    if not transposes(model):
        return
    for linear in model.modules():
        if isinstance(linear, nn.Linear) and transposed_is_faster(linear.in_features, linear.out_features):
            linear.weight = nn.Parameter(transposed(linear.weight.detach()), linear.weight.requires_grad)
    served_forward.forget(model)


@functools.cache
def transposed_is_faster(in_features: int, out_features: int) -> bool:
    """Whether a float32 product of this shape is at least MIN_SPEEDUP faster on this CPU (and
    thread count) with its weight stored transposed (`speedup`)."""
    generator = torch.Generator().manual_seed(0)  # torch's own random state stays as it was
    weight = torch.randn(out_features, in_features, generator=generator)
    plain, stored_transposed = (functools.partial(F.linear, weight=w) for w in (weight, transposed(weight)))
    return speedup(plain, stored_transposed, in_features, TRANSPOSED_DTYPE, generator) >= MIN_SPEEDUP


@functools.cache
def paired_is_faster(in_features: int, out_features: int) -> bool:
    """Whether a bfloat16 product of this shape is at least MIN_SPEEDUP faster on this CPU (and
    thread count) with its weight in pairs for reflow's kernel than packed for oneDNN's (`speedup`);
    False where the kernel does not multiply here or takes no such shape."""
    if not native.multiplies_pairs() or out_features % native.PAIRED_BLOCK or in_features % 2:
        return False
    generator = torch.Generator().manual_seed(0)
    linear = plain_linear(torch.randn(out_features, in_features, generator=generator).to(PACKED_DTYPE), None)
    onednn, paired = PackedLinear(linear), PackedLinear(linear, paired=True)
    return speedup(onednn, paired, in_features, PACKED_DTYPE, generator) >= MIN_SPEEDUP


def speedup(
    before: Callable[[Tensor], Tensor],
    after: Callable[[Tensor], Tensor],
    in_features: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> float:
    """How much faster `after` multiplies rows of `in_features` in `dtype` than `before`, on this
    CPU: the geometric mean over TIMED_ROWS of the ratio of each one's least time of TIMED_PRODUCTS,
    the two interleaved."""
    speedups = []
    with torch.inference_mode():
        for rows in TIMED_ROWS:
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            times: tuple[list[float], list[float]] = ([], [])
            for call in range(TIMED_PRODUCTS + 1):
                for product, spent in zip((before, after), times, strict=True):
                    started = time.perf_counter()
                    product(x)
                    if call > 0:  # the first warms up
                        spent.append(time.perf_counter() - started)
            speedups.append(min(times[0]) / min(times[1]))
    return statistics.geometric_mean(speedups)


def transposed(weight: Tensor) -> Tensor:
    """`weight` [out, in] stored transposed: the same values and shape, over an [in, out] tensor."""
    return weight.t().contiguous().t()


@functools.cache
def rows_for_same_bits(in_features: int, out_features: int, bias: bool) -> int | None:
    """The fewest rows (1, 2, 4 or 8) a packed product of this shape must be padded to for each row
    to come out with the same bits at every row count up to ROW_CHUNK and at every place among them
    as it does alone, on this CPU (and thread count); None when padding to MAX_PADDED_ROWS is not
    enough."""
    weight, rows = order_probe(in_features, out_features)
    generator = torch.Generator().manual_seed(1)
    bias_values = torch.randn(out_features, generator=generator).to(PACKED_DTYPE) if bias else None
    min_rows = 1
    with torch.inference_mode():
        while min_rows <= MAX_PADDED_ROWS:
            packed = PackedLinear(plain_linear(weight, bias_values), min_rows)
            alone = torch.cat([packed(row) for row in rows.split(1)])
            if all(torch.equal(packed(rows[:n]), alone[:n]) for n in range(2, ROW_CHUNK + 1)):
                return min_rows
            min_rows *= 2
    return None


def order_probe(in_features: int, out_features: int) -> tuple[Tensor, Tensor]:
    """A weight and ROW_CHUNK rows (bfloat16) whose products show any change in the order a row's
    sum is taken in: a quarter of each row's inputs cancel another quarter's exactly (read with the
    same weights, negated, at scales up to 2**12), so what is left of a sum is mostly the rounding of
    its large partial sums, which depends on their order, and survives the rounding to bfloat16.
    Plain random rows hide most such changes: a float32 sum taken in another order rounds to the
    same bfloat16 but in a few outputs (on 2 cores of a Xeon without AVX-512 BF16, where oneDNN sums
    a lone row in another order than a batch's, a 64x128 product showed it in 6 draws of 20)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    rows = torch.randn(ROW_CHUNK, in_features, generator=generator)
    pairs = in_features // 4
    weight[:, pairs : 2 * pairs] = weight[:, :pairs]
    rows[:, :pairs] *= 2.0 ** torch.randint(0, 13, (ROW_CHUNK, pairs), generator=generator)
    rows[:, pairs : 2 * pairs] = -rows[:, :pairs]
    return weight.to(PACKED_DTYPE), rows.to(PACKED_DTYPE)


def plain_linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An nn.Linear holding `weight` [out, in] and `bias` themselves (nothing allocated or
    initialised), frozen."""
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear
