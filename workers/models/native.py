"""reflow's C++ kernels on the CPU, compiled for this CPU the first time a process needs them: paged
attention for bfloat16, float16 and float32 (`paged_attention.cpp`), RMSNorm for bfloat16 and
float16 in served forwards (`rms_norm.cpp`), the product of bfloat16 rows with a weight-only
copy's int8 layers (`int8_linear.cpp`), bfloat16 products on CPUs with AVX-512 BF16
(`paired_linear.cpp`), and a served bfloat16 forward's decoder layers in one call where every
product is paired or int8 (`decoder_layers.cpp`: those kernels called from C++, no Python between
them).

Why: a decode step's attention made of torch operators (`kv_cache.grouped_attention`: gather the
blocks, two batched products, a masked float32 softmax) is a dozen small kernels a layer, and
bfloat16 products as small as one query's cost far more than their arithmetic where the CPU has no
bfloat16 instructions. The kernel reads each sequence's keys and values in place in its blocks, once
for all the queries that share them, and computes in float32 in the CPU's vector instructions,
for heads a multiple of LANES wide. Measured with `benchmarks/decode_attention.py`
(docs/benchmarks.md).

Its arithmetic is its own: bits differ from the torch operators' (it rounds once, they round the
scores to bfloat16 too; in float32 it sums in its own order, not that of torch's fused kernel,
transformers' `sdpa`), so a process uses one or the other throughout, and a token's attention
is the same computation however it is batched (the source file says how). float32 attends here
too: a float32 step on the CPU is its weights' GEMMs more than its attention, but where the kernel
attends a step runs in one packed forward (workers/runner.py), which took a float32 SmolLM2 from
72 to 87 tokens/s at 16 streams on an AVX2 EPYC (docs/benchmarks.md). A compiled step
(`torch.compile`) attends through the torch operators, which inductor fuses.

RMSNorm: torch's norm is a composite of eight operators (a cast, a square, a mean, an add, rsqrt, a
product, a cast back, the weight's product), 70 us a norm at 16 rows of SmolLM2 in bfloat16 on 2
cores of a Xeon, 61 norms a step. The kernel is one pass over each row with transformers'
arithmetic except the order in which it sums the squares (the source file says how), so a row's
bits are the same in any batch and differ from transformers' in one element in 10,000 to 100,000.
float32 keeps torch's operators (float32 greedy tokens are transformers'), and so does anything
autograd differentiates (a fine-tune's forward): the kernel normalises where no gradient is
recorded, as a worker's forwards and evaluations run.

int8 products: torch's `_weight_int8pack_mm` reads a weight at well under the machine's bandwidth
(SmolLM2's int8 layers at one row at 10-15 GB/s on 2 cores of an AMD EPYC that reads 27), holds
each channel's weights as a row of their own, and takes one scale a channel. The kernel takes the
weights of each 16 channels together, input by input (`blocks_of`), so that a tile of rows reads
them as one stream, and a scale per INT8_GROUP inputs (its copy agrees on more of float32's
tokens): SmolLM2's layers took 0.38-0.87x torch's time at one row, 0.33-0.83x at 16 and 64
(int8_linear.cpp says how it computes; `precision.Int8Linear` holds every int8 layer laid out for
it).

bfloat16 products: oneDNN's packed products (`linears.PackedLinear`) read SmolLM2's weights at 27
GB/s at one row on 2 cores of an AMD EPYC with AVX-512 BF16 that reads 41-50, 20-45 us a call for
its 0.7-3.5 MB layers, and round a row differently alone than among others in some shapes (padded
for it). The kernel multiplies weights laid out in pairs of inputs with AVX-512 BF16's dot
product of pairs, each output summed in one order at any row count: there a decode step of SmolLM2
took 0.76x the time at one row, 0.78x at 16 and 0.85x at 64 (`benchmarks/weight_layouts.py --dtype
bfloat16`; paired_linear.cpp says how it computes; `linears.paired_is_faster` measures which kernel
a shape takes).

The sources are compiled with the C++ compiler `CXX` names (else `g++`, `c++`), `-march=native`,
into a private temporary directory, in about 2 s, and loaded from there; OpenMP resolves to the
runtime torch already loaded, so the kernels' threads are torch's. Their vectors are no wider than
the CPU's: GCC computes a wider one piece by piece (a test fails on any such operation). Where no
compiler is found or the build fails, a warning names the fix and attention and norms run as torch
operators.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

ATTENTION_SOURCE = Path(__file__).with_name("paged_attention.cpp")
NORM_SOURCE = Path(__file__).with_name("rms_norm.cpp")
INT8_SOURCE = Path(__file__).with_name("int8_linear.cpp")
PAIRED_SOURCE = Path(__file__).with_name("paired_linear.cpp")
LAYERS_SOURCE = Path(__file__).with_name("decoder_layers.cpp")
OTHER_SOURCES = (NORM_SOURCE, INT8_SOURCE, PAIRED_SOURCE, LAYERS_SOURCE)  # built with the attention's
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-I{Path(__file__).parent}")  # vectors.h
SYMBOLS = {
    torch.bfloat16: "paged_attention_bfloat16",
    torch.float16: "paged_attention_float16",
    torch.float32: "paged_attention_float32",
}
NORM_SYMBOLS = {torch.bfloat16: "rms_norm_bfloat16", torch.float16: "rms_norm_float16"}
INT8_SYMBOL = "int8_linear_bfloat16"
PAIRED_SYMBOL = "paired_linear_bfloat16"
PAIRED_BLOCK = 16  # output channels whose weights lie in pairs together (paired_linear.cpp)
LAYERS_SYMBOL = "decoder_layers_bfloat16"
# a layer's pointers as decoder_layers.cpp reads them (None: no bias, or no scales)
LAYER_POINTERS = (
    "input_norm", "qkv", "qkv_scales", "qkv_bias", "o", "o_scales", "o_bias",
    "post_norm", "gate_up", "gate_up_scales", "gate_up_bias", "down", "down_scales", "down_bias",
)  # fmt: skip
PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products, by the names of their weights
FALLBACK = "attention, norms and int8 products on the CPU run as torch operators, slower"
INSTALL_HINT = "install a C++ compiler (e.g. `apt-get install g++`) or name one in CXX"
LANES = 8  # the kernels read features 8 at a time (vectors.h): a head's, or a normed row's, a multiple of it

# q, k, v, rope, the two pools, write, read, positions, starts, out, dims; scale; threads
ARGUMENTS = [ctypes.c_void_p] * 12 + [ctypes.c_float, ctypes.c_int]
# x, weight, out; rows, width; eps; threads
NORM_ARGUMENTS = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int]
# x, weight, scales, out; rows, width, channels; threads
INT8_ARGUMENTS = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
PAIRED_ARGUMENTS = INT8_ARGUMENTS  # x, weight, bias, out; rows, width, channels; threads
# x, layers, count; pools, a layer's stride; the attention's; sizes, eps, silu, int8, threads
LAYERS_ARGUMENTS = [
    *(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64),
    *[ctypes.c_void_p] * 6,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_int,
]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernels, compiled and loaded once per process; None (said once, in the log) where they
    cannot be built here."""
    return build(ATTENTION_SOURCE)


def build(attention_source: Path) -> ctypes.CDLL | None:
    """The kernels, the attention of `attention_source` (ATTENTION_SOURCE, or another version of it),
    compiled for this CPU and loaded; None, with a warning naming the fix, where they cannot be
    built here."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("%s: %s", FALLBACK, INSTALL_HINT)
        return None
    sources = (attention_source, *OTHER_SOURCES)
    with tempfile.TemporaryDirectory(prefix="reflow-kernels-") as directory:  # 0700
        built = Path(directory) / "kernels.so"
        try:
            result = subprocess.run(
                [compiler, *FLAGS, *map(str, sources), "-o", str(built)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            result = subprocess.CompletedProcess([compiler], 1, "", str(error))
        if result.returncode != 0:
            names = ", ".join(source.name for source in sources)
            logger.warning(
                "%s: %s failed to build %s (%s); %s",
                FALLBACK, compiler, names, result.stderr.strip()[-500:], INSTALL_HINT,
            )  # fmt: skip
            return None
        library = ctypes.CDLL(str(built))  # mapped: the file may go
    for symbols, arguments in (
        (SYMBOLS.values(), ARGUMENTS),
        (NORM_SYMBOLS.values(), NORM_ARGUMENTS),
        ([INT8_SYMBOL], INT8_ARGUMENTS),
        ([PAIRED_SYMBOL], PAIRED_ARGUMENTS),
        ([LAYERS_SYMBOL], LAYERS_ARGUMENTS),
    ):
        for symbol in symbols:
            function = getattr(library, symbol)
            function.argtypes, function.restype = arguments, None
    return library


def available(dtype: torch.dtype) -> bool:
    """Whether the kernel attends in `dtype` in this process (compiling it the first time)."""
    return dtype in SYMBOLS and _library() is not None


def attends(q: Tensor) -> bool:
    """Whether the kernel attends queries `q` ([..., D]): on the CPU, in a dtype it takes, with D
    a multiple of LANES, where it builds."""
    return q.device.type == "cpu" and q.shape[-1] % LANES == 0 and available(q.dtype)


def paged_attention(
    k_pool: Tensor,
    v_pool: Tensor,
    block_size: int,
    write: Tensor,
    read: Tensor,
    positions: Tensor,
    starts: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rope: Tensor | None,
    window: int,
    scale: float,
) -> Tensor:
    """Turns the tokens' q and k by `rope` ([N, 2, D], contiguous: each token's cos and signed sin,
    as `rotary.Rotation` holds them; None: they were turned already), stores k and v ([N, KVH, D])
    in the token slots `write` [N] of one layer's pools ([slots, KVH, D], contiguous), then attends
    each query (q [N, H, D]) to the keys at positions 0 to its own (`positions` [N]; the last
    `window` of them if set) of its sequence: tokens starts[b] to starts[b + 1] are sequence b's,
    whose blocks are `read[b]` ([R, N_read]; starts: [R + 1]). Returns [N, H, D]. `attends(q)` must
    be true.

    A turned feature is rounded as `Rotation`'s operators in q's dtype round it (x * cos and the
    swapped half's feature * sin each rounded, then their sum), so its bits are theirs."""
    _, heads, d = q.shape
    if any(x.stride(2) != 1 or x.stride(1) != d for x in (q, k, v)):
        strides = ", ".join(str(x.stride()) for x in (q, k, v))
        raise ValueError(f"each token's heads must lie side by side in q, k and v: strides {strides}")
    assert all(x.dtype == q.dtype for x in (k, v, k_pool, v_pool)), "q, k, v and the pools in one dtype"
    bound = bind_attention(
        block_size, write, read, positions, starts, rope, (heads, k.shape[1], d), window, scale, q.dtype,
        (q.stride(0), k.stride(0), v.stride(0)),
    )  # fmt: skip
    return bound(k_pool, v_pool, q, k, v)


@dataclass(frozen=True)
class BoundAttention:
    """`paged_attention` for one forward's tokens, everything bound but each layer's pools and its
    q, k and v: the view's tensors made contiguous and the kernel's dimensions packed once a
    forward, not once a layer (`bind_attention`)."""

    function: Callable[..., None]  # the kernel for the dtype
    tensors: tuple[Tensor | None, ...]  # write, read, positions, starts, rope (or None): kept alive here
    pointers: tuple[int | None, ...]  # their data
    dims: ctypes.Array[ctypes.c_int64]
    shape: tuple[int, int, int]  # the output's: [N, H, D]
    dtype: torch.dtype
    scale: float
    threads: int

    def __call__(self, k_pool: Tensor, v_pool: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One layer's attention: q [N, H, D], k and v [N, KVH, D] laid out with the token strides
        it was bound with, each token's heads side by side; the pools contiguous. Returns [N, H, D]."""
        assert k_pool.is_contiguous() and v_pool.is_contiguous() and len(q) == self.shape[0]
        assert q.dtype == k.dtype == v.dtype == k_pool.dtype == v_pool.dtype == self.dtype
        out = torch.empty(self.shape, dtype=self.dtype)
        write, read, positions, starts, rope = self.pointers
        self.function(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), rope, k_pool.data_ptr(), v_pool.data_ptr(), write,
            read, positions, starts, out.data_ptr(), self.dims, self.scale, self.threads,
        )  # fmt: skip
        return out


def bind_attention(
    block_size: int,
    write: Tensor,
    read: Tensor,
    positions: Tensor,
    starts: Tensor,
    rope: Tensor | None,
    heads: tuple[int, int, int],
    window: int,
    scale: float,
    dtype: torch.dtype,
    token_strides: tuple[int, int, int],
) -> BoundAttention:
    """`paged_attention`'s call for tokens at `positions` with these slots, blocks and rope, `heads`
    (query heads, key/value heads, head width) and `token_strides` (q's, k's and v's between two
    tokens), bound for every layer of one forward. `available(dtype)` must be true."""
    library = _library()
    assert library is not None
    n, (query_heads, kv_heads, d) = len(positions), heads
    assert starts.shape == (read.shape[0] + 1,) and write.shape == positions.shape == (n,)
    if rope is not None:
        assert rope.dtype == dtype and rope.shape == (n, 2, d) and rope.is_contiguous()
    write, read, positions, starts = (x.contiguous() for x in (write, read, positions, starts))
    tensors = (write, read, positions, starts, rope)
    dims = (ctypes.c_int64 * 11)(
        read.shape[0], n, query_heads, kv_heads, d, read.shape[1], block_size, window, *token_strides
    )  # fmt: skip
    return BoundAttention(
        getattr(library, SYMBOLS[dtype]), tensors, tuple(x if x is None else x.data_ptr() for x in tensors),
        dims, (n, query_heads, d), dtype, scale, torch.get_num_threads(),
    )  # fmt: skip


def normalizes(x: Tensor, weight: Tensor) -> bool:
    """Whether `rms_norm` normalises `x` with `weight` here: on the CPU, in bfloat16 or float16 (the
    weight's dtype and device too, one weight a feature), rows a multiple of LANES wide, with no
    gradient recorded and no step being compiled, where the kernels build."""
    return (
        x.device.type == "cpu"
        and x.dtype in NORM_SYMBOLS
        and (weight.dtype, weight.device, weight.shape) == (x.dtype, x.device, x.shape[-1:])
        and x.shape[-1] > 0
        and x.shape[-1] % LANES == 0
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and _library() is not None
    )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm of `x` [..., W] scaled by `weight` [W], its squares summed in the
    kernel's order (rms_norm.cpp). `normalizes(x, weight)` must be true."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    rms_norm_into(rows, weight.contiguous(), eps, out)
    return out.view(x.shape)


def rms_norm_into(rows: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
    """`rms_norm` of contiguous `rows` [N, W] with a contiguous `weight`, written into `out` (as
    `rows`): for callers that checked `normalizes` once for many norms (served_forward.py)."""
    library = _library()
    assert library is not None
    getattr(library, NORM_SYMBOLS[rows.dtype])(
        rows.data_ptr(), weight.data_ptr(), out.data_ptr(), len(rows), rows.shape[-1], eps,
        torch.get_num_threads(),
    )  # fmt: skip


def multiplies_int8(rows: Tensor) -> bool:
    """Whether `int8_linear` multiplies `rows` here: bfloat16 on the CPU, with no gradient recorded
    and no step being compiled, where the kernels build."""
    return (
        rows.device.type == "cpu"
        and rows.dtype == torch.bfloat16
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and _library() is not None
    )


INT8_BLOCK = 16  # output channels whose int8 weights lie together input by input (int8_linear.cpp)
INT8_GROUP = 32  # inputs of an int8 weight's scale (int8_linear.cpp; llama.cpp's Q8_0 takes as many)


def blocks_of(weight: Tensor) -> Tensor:
    """int8 weights [M, K] (M a multiple of INT8_BLOCK), or their scales [M, groups], laid out for
    `int8_linear`: [M / 16, K, 16], each 16 output channels' together, input by input."""
    m, k = weight.shape
    return weight.view(m // INT8_BLOCK, INT8_BLOCK, k).transpose(1, 2).contiguous()


def unblocked(blocks: Tensor) -> Tensor:
    """The weights [M, K] (or scales) that `blocks_of` laid out as `blocks`."""
    count, k, block = blocks.shape
    return blocks.transpose(1, 2).reshape(count * block, k)


def int8_linear(rows: Tensor, blocks: Tensor, scales: Tensor) -> Tensor:
    """rows W^T of bfloat16 `rows` [N, K] (contiguous) and int8 W [M, K] laid out as `blocks`, each
    INT8_GROUP inputs of a channel times its bfloat16 scale (`scales` [M, groups], laid out
    likewise; `blocks_of`): [N, M] bfloat16, each row's the same bits in any batch
    (int8_linear.cpp). `multiplies_int8(rows)` must be true."""
    count, width = rows.shape
    channels, groups = blocks.shape[0] * INT8_BLOCK, -(-width // INT8_GROUP)
    assert all(x.is_contiguous() for x in (rows, blocks, scales))
    assert blocks.dtype == torch.int8 and blocks.shape[1:] == (width, INT8_BLOCK)
    assert scales.dtype == torch.bfloat16 and scales.shape == (len(blocks), groups, INT8_BLOCK)
    out = torch.empty(count, channels, dtype=torch.bfloat16)
    library = _library()
    assert library is not None
    getattr(library, INT8_SYMBOL)(
        rows.data_ptr(), blocks.data_ptr(), scales.data_ptr(), out.data_ptr(), count, width, channels,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


@functools.cache
def multiplies_pairs() -> bool:
    """Whether `bind_paired`'s products multiply here: the kernels build, for a CPU with AVX-512 BF16."""
    library = _library()
    return library is not None and library.paired_linear_built() == 1


def pairs_of(weight: Tensor) -> Tensor:
    """A bfloat16 `weight` [M, K] (M a multiple of PAIRED_BLOCK, K even) laid out for
    `bind_paired`: [M / 16, K / 2, 16, 2], each 16 output channels' weights in pairs of inputs."""
    m, k = weight.shape
    return weight.view(m // PAIRED_BLOCK, PAIRED_BLOCK, k // 2, 2).transpose(1, 2).contiguous()


def unpaired(pairs: Tensor) -> Tensor:
    """The weight [M, K] that `pairs_of` laid out as `pairs`."""
    blocks, half, block, _ = pairs.shape
    return pairs.transpose(1, 2).reshape(blocks * block, half * 2)


def bind_paired(pairs: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    """The product rows W^T + bias of contiguous bfloat16 `rows` [N, K] with W laid out as `pairs`
    (`pairs_of`): [N, M] bfloat16, each row's the same bits in any batch (paired_linear.cpp). The
    weights and bias are checked and bound once, not once a call: SmolLM2's 576x576 product at one
    row, its weights in cache, took 6.4 us called so and 8.9 through its layer's forward, 4.2 of
    them in the kernel (2 cores of an AMD EPYC). `multiplies_pairs()` must be true."""
    library = _library()
    assert library is not None
    channels, width = pairs.shape[0] * PAIRED_BLOCK, pairs.shape[1] * 2
    assert pairs.dtype == torch.bfloat16 and pairs.is_contiguous() and pairs.shape[2:] == (PAIRED_BLOCK, 2)
    if bias is not None:
        assert bias.shape == (channels,)
        bias = bias.to(torch.bfloat16).contiguous()
    function, added = getattr(library, PAIRED_SYMBOL), bias

    def product(rows: Tensor) -> Tensor:  # holds `pairs` and the bias: alive while it is
        out = torch.empty(len(rows), channels, dtype=torch.bfloat16)
        function(
            rows.data_ptr(), pairs.data_ptr(), None if added is None else added.data_ptr(), out.data_ptr(),
            len(rows), width, channels, torch.get_num_threads(),
        )  # fmt: skip
        return out

    return product


SILU_ROW = 64  # torch's silu of bfloat16 takes 64 values a vector step, a row's tail one at a time


@functools.cache
def silu_table() -> Tensor:
    """torch's silu of every bfloat16 value, [65,536] bfloat16 indexed by the value's bits: what
    decoder_layers.cpp reads silu(gate) from, so its bits are torch's wherever torch computes a row in
    vector steps (rows a multiple of SILU_ROW wide; the vector and scalar exp may round apart)."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int16).roll(2**15).view(torch.bfloat16)
    with torch.inference_mode():
        return torch.nn.functional.silu(values)


@dataclass(frozen=True)
class DecoderLayers:
    """A model's decoder layers as decoder_layers.cpp runs them, bound once (`bind_decoder_layers`)."""

    function: Callable[..., None]
    pointers: ctypes.Array[ctypes.c_void_p]  # LAYER_POINTERS a layer
    count: int  # layers
    int8: bool  # the products int8 (int8_linear.cpp), else paired (paired_linear.cpp)
    tensors: tuple[Tensor, ...]  # what they point into: kept alive here
    sizes: ctypes.Array[ctypes.c_int64]  # dim, q width, k and v width, intermediate width
    eps: float
    silu: Tensor  # silu_table()

    def __call__(self, x: Tensor, k_pools: Tensor, v_pools: Tensor, attention: BoundAttention) -> None:
        """Runs every layer over the forward's rows `x` [N, dim] (contiguous bfloat16, updated in
        place), its keys and values written to and read from the pools [layers, slots, KVH, D]
        (contiguous) as `attention` (bound for the forward, with the qkv product's token strides)
        says."""
        assert x.is_contiguous() and k_pools.is_contiguous() and v_pools.is_contiguous()
        assert x.dtype == k_pools.dtype == v_pools.dtype == attention.dtype == torch.bfloat16
        assert len(x) == attention.shape[0] and len(k_pools) == len(v_pools) == self.count
        write, read, positions, starts, rope = attention.pointers
        self.function(
            x.data_ptr(), self.pointers, self.count, k_pools.data_ptr(), v_pools.data_ptr(),
            k_pools.stride(0), write, read, positions, starts, rope, attention.dims, attention.scale,
            self.sizes, self.eps, self.silu.data_ptr(), self.int8, attention.threads,
        )  # fmt: skip


def bind_decoder_layers(
    layers: list[dict[str, Tensor | None]], int8: bool, sizes: tuple[int, int, int, int], eps: float
) -> DecoderLayers:
    """The layers whose tensors `layers` names (LAYER_POINTERS each: the norms' weights, each
    product's weights, its scales and its bias, or None for a bias or scales it has not), of
    `sizes` (dim, q width, k and v width, intermediate width, the last a multiple of SILU_ROW) and
    norms of `eps`, bound for decoder_layers.cpp. The products' weights are int8 (`int8`: they and
    their bfloat16 scales laid out by `blocks_of`) or bfloat16 in pairs (`pairs_of`, where
    `multiplies_pairs()`); everything else bfloat16."""
    library = _library()
    assert library is not None and sizes[3] % SILU_ROW == 0
    tensors, addresses = [], []
    for layer in layers:
        assert set(layer) == set(LAYER_POINTERS)
        for name in LAYER_POINTERS:
            tensor = layer[name]
            if tensor is not None:
                wanted = torch.int8 if int8 and name in PRODUCTS else torch.bfloat16
                assert tensor.dtype == wanted and tensor.is_contiguous(), name
                tensors.append(tensor)
            if name.endswith("_scales"):  # an int8 product's alone
                assert (tensor is not None) == int8, name
            addresses.append(None if tensor is None else tensor.data_ptr())
    return DecoderLayers(
        getattr(library, LAYERS_SYMBOL), (ctypes.c_void_p * len(addresses))(*addresses), len(layers), int8,
        tuple(tensors), (ctypes.c_int64 * 4)(*sizes), eps, silu_table(),
    )  # fmt: skip
