"""The native kernels on the CPU (native.py): paged attention that bfloat16, float16 and float32
attend with, the RMSNorm of served bfloat16 and float16 forwards, and the product of bfloat16 rows
with a weight-only copy's large int8 layers."""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.models import native
from workers.models.kv_cache import CacheView, PagedKVCache, grouped_attention, paged_attention
from workers.models.llama import LlamaConfig, RMSNorm, rope_table
from workers.models.precision import Int8Linear
from workers.models.rotary import Rotation

HEADS, KV_HEADS, HEAD_DIM, LAYERS, LAYER = 6, 2, 16, 3, 1
CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

needs_kernel = pytest.mark.skipif(
    not native.available(torch.bfloat16), reason="needs a C++ compiler (g++) to build the kernel"
)


def filled_cache(
    rows: int, held: int, dtype: torch.dtype, seed: int, head_dim: int = HEAD_DIM
) -> tuple[PagedKVCache, list[list[int]]]:
    """A pool of random keys and values, and `rows` block tables of `held` tokens each, their blocks
    shuffled through the pool as a running server's are."""
    generator = torch.Generator().manual_seed(seed)
    per_row = -(-held // 16)
    cache = PagedKVCache(LAYERS, KV_HEADS, head_dim, 1 + rows * per_row, CPU, dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    blocks = (1 + torch.randperm(rows * per_row, generator=generator)).tolist()
    return cache, [blocks[r * per_row : (r + 1) * per_row] for r in range(rows)]


def new_tokens(
    rows: int, tokens: int, dtype: torch.dtype, seed: int, head_dim: int = HEAD_DIM
) -> tuple[torch.Tensor, ...]:
    """q, k and v of a forward as the decoder hands them over: views of the fused projection's
    product, not turned yet."""
    generator = torch.Generator().manual_seed(seed)
    product = torch.randn(rows, tokens, (HEADS + 2 * KV_HEADS) * head_dim, generator=generator).to(dtype)
    parts = product.split([HEADS * head_dim, KV_HEADS * head_dim, KV_HEADS * head_dim], -1)
    q, k, v = (part.unflatten(-1, (-1, head_dim)) for part in parts)
    return q, k, v


def rotation_of(
    positions: torch.Tensor, dtype: torch.dtype, pairs: bool = False, head_dim: int = HEAD_DIM
) -> Rotation:
    """The rotation of `positions` [B, T] as the decoder makes it from `rope_table`: halves in
    `dtype` (as transformers turns), or pairs in float32 (the built-in model's)."""
    config = LlamaConfig.from_json(
        {"model_type": "llama", "vocab_size": 16, "hidden_size": HEADS * head_dim, "intermediate_size": 16,
         "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    )  # fmt: skip
    table = rope_table(replace(config, interleaved_rope=pairs), int(positions.max()) + 1)[positions]
    return Rotation.of(table if pairs else table.to(dtype), pairs)


def attend(
    cache: PagedKVCache, view: CacheView, qkv: tuple[torch.Tensor, ...], window: int, pairs: bool = False
) -> torch.Tensor:
    """One layer's attention through `paged_attention`, as the decoder calls it."""
    q, k, v = qkv
    turn = rotation_of(view.positions, q.dtype, pairs, q.shape[-1])
    mask = None if view.packed else view.mask(window)
    return paged_attention(cache, LAYER, view, q, k, v, mask, turn, window, q.shape[-1] ** -0.5)


def gathered(cache: PagedKVCache, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys and values as written, read from its blocks: [B, KVH, S, D] each."""
    head_dim = cache.k.shape[-1]
    shape = (cache.n_blocks, cache.block_size, KV_HEADS, head_dim)
    keys, values = (
        pool[LAYER].view(shape)[view.read.reshape(-1)].view(view.read.shape[0], -1, KV_HEADS, head_dim)
        for pool in (cache.k, cache.v)
    )
    return keys.transpose(1, 2), values.transpose(1, 2)


def float32_attention(cache: PagedKVCache, view: CacheView, q: torch.Tensor, window: int) -> torch.Tensor:
    """The same attention over the cache as written, in float32 by torch's fused kernel: [B, H, T, D]."""
    keys, values = gathered(cache, view)
    return F.scaled_dot_product_attention(
        q.transpose(1, 2).float(), keys.float(), values.float(), attn_mask=view.mask(window).allowed,
        scale=HEAD_DIM**-0.5, enable_gqa=True,
    )  # fmt: skip


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process where the kernel cannot be built; built again after the test."""
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    native._library.cache_clear()
    yield
    monkeypatch.undo()
    native._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_computes_attention_in_float32_rounded_once(
    dtype: torch.dtype, tokens: int, window: int
) -> None:
    rows, held = 3, 70
    cache, tables = filled_cache(rows, held + tokens, dtype, seed=0)
    positions = [[held - 9 * r + i for i in range(tokens)] for r in range(rows)]  # rows of different lengths
    view = cache.view(tables, positions, CPU)
    q, k, v = new_tokens(rows, tokens, dtype, seed=1)
    turn = rotation_of(view.positions, dtype)
    got = attend(cache, view, (q, k, v), window)  # turns q and k, writes the new keys and values first
    written = cache.k[LAYER, view.write.reshape(-1)].view(rows, tokens, KV_HEADS, HEAD_DIM)
    assert torch.equal(written, turn(k))
    torch.testing.assert_close(got, float32_attention(cache, view, turn(q), window).to(dtype))


@needs_kernel
@pytest.mark.parametrize("pairs", [False, True], ids=["halves", "pairs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_and_k_are_turned_with_the_bits_of_the_torch_operators(dtype: torch.dtype, pairs: bool) -> None:
    """In the kernel (halves in their own dtype, transformers' rotation) or before it (pairs in
    float32, the built-in model's), q and k are turned as `Rotation`'s operators turn them."""
    rows, tokens, held = 2, 4, 30
    turned_first, tables = filled_cache(rows, held + tokens, dtype, seed=6)
    turned_inside, _ = filled_cache(rows, held + tokens, dtype, seed=6)
    positions = [[held - 5 * r + i for i in range(tokens)] for r in range(rows)]
    view = turned_first.view(tables, positions, CPU)
    q, k, v = new_tokens(rows, tokens, dtype, seed=7)
    turn = rotation_of(view.positions, dtype, pairs)
    expected = native.paged_attention(
        turned_first.k[LAYER], turned_first.v[LAYER], turned_first.block_size, view.write.view(-1),
        view.read, view.positions.view(-1), view.starts, turn(q).flatten(0, 1), turn(k).flatten(0, 1),
        v.flatten(0, 1), None, 0, HEAD_DIM**-0.5,
    ).unflatten(0, (rows, tokens)).transpose(1, 2)  # fmt: skip
    got = attend(turned_inside, view, (q, k, v), window=0, pairs=pairs)
    assert torch.equal(got, expected)
    assert torch.equal(turned_inside.k, turned_first.k) and torch.equal(turned_inside.v, turned_first.v)


@needs_kernel
@pytest.mark.parametrize("window", [0, 12])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_query_has_the_same_bits_alone_in_a_batch_in_a_chunk_and_packed(
    dtype: torch.dtype, window: int
) -> None:
    rows, tokens, held = 3, 11, 40
    cache, tables = filled_cache(rows, held + tokens, dtype, seed=2)
    positions = [[held - 7 * r + i for i in range(tokens)] for r in range(rows)]
    q, k, v = new_tokens(rows, tokens, dtype, seed=3)
    batched = attend(cache, cache.view(tables, positions, CPU), (q, k, v), window)  # [B, H, T, D]
    for row in range(rows):
        for token in range(tokens):  # each token alone, its own and earlier keys in the cache already
            at = slice(token, token + 1)
            one = (q[row : row + 1, at], k[row : row + 1, at], v[row : row + 1, at])
            alone = attend(cache, cache.view([tables[row]], [positions[row][at]], CPU), one, window)
            assert torch.equal(alone[0, :, 0], batched[row, :, token])
    # packed: every token a row, the sequences' of different lengths (1, 5 and 9 tokens)
    spans = [(row, slice(tokens - 1 - 4 * row, tokens)) for row in range(rows)]
    view = cache.packed_view([tables[r] for r, _ in spans], [positions[r][at] for r, at in spans], CPU)
    assert view.packed and view.starts.tolist() == [0, 1, 6, 15]
    flat = (torch.cat([x[r, at] for r, at in spans])[:, None] for x in (q, k, v))  # [N, 1, heads, D]
    packed = attend(cache, view, tuple(flat), window)[:, :, 0]  # [N, H, D]
    assert torch.equal(packed, torch.cat([batched[r, :, at].transpose(0, 1) for r, at in spans]))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_decode_batch_read_slot_by_slot_gives_each_query_its_bits_alone(dtype: torch.dtype) -> None:
    """Rows enough for the kernel's work items to attend through all key/value heads of each slot
    (the batch), where a lone row attends head by head: the same bits either way, and float32
    attention's values."""
    rows = 4 * torch.get_num_threads() + 1
    cache, tables = filled_cache(rows, 40, dtype, seed=6)
    positions = [[38 - 3 * (r % 5)] for r in range(rows)]  # rows of different lengths
    view = cache.view(tables, positions, CPU)
    q, k, v = new_tokens(rows, 1, dtype, seed=7)
    batched = attend(cache, view, (q, k, v), window=0)  # [B, H, 1, D]
    turned = rotation_of(view.positions, dtype)(q)
    torch.testing.assert_close(batched, float32_attention(cache, view, turned, window=0).to(dtype))
    for row in range(rows):
        one = (q[row : row + 1], k[row : row + 1], v[row : row + 1])
        alone = attend(cache, cache.view([tables[row]], [positions[row]], CPU), one, window=0)
        assert torch.equal(alone[0], batched[row])


def assert_attends_as_torch_operators(head_dim: int) -> None:
    """A bfloat16 layer's attention is `grouped_attention`'s, bit for bit."""
    cache, tables = filled_cache(2, 30, torch.bfloat16, seed=4, head_dim=head_dim)
    view = cache.view(tables, [[29], [20]], CPU)
    q, k, v = new_tokens(2, 1, torch.bfloat16, seed=5, head_dim=head_dim)
    got = attend(cache, view, (q, k, v), window=0)
    keys, values = gathered(cache, view)
    turned = rotation_of(view.positions, torch.bfloat16, head_dim=head_dim)(q)
    assert torch.equal(
        got, grouped_attention(turned.transpose(1, 2), keys, values, view.mask(), head_dim**-0.5)
    )


def test_without_a_compiler_attention_norms_and_int8_products_run_as_torch_operators(
    no_compiler: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert not native.available(torch.bfloat16)
    assert "install a C++ compiler (e.g. `apt-get install g++`)" in caplog.text
    assert_attends_as_torch_operators(HEAD_DIM)
    norm, x = random_norm(torch.bfloat16, 64, seed=0)
    with torch.inference_mode():
        assert not native.normalizes(x, norm.weight)
        assert torch.equal(norm(x), as_torch_operators(norm, x))
        layer = Int8Linear(torch.nn.Linear(1024, 96, bias=False))
        rows = torch.randn(3, 1024).to(torch.bfloat16)
        assert not native.multiplies_int8(rows)
        assert torch.equal(layer(rows), F.linear(rows, layer.dequantized()))


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or shutil.which("g++") is None,
    reason="needs g++ and an x86 CPU with AVX2: the kernels' vectors are sized for AVX2 and AVX-512",
)
def test_the_kernels_compile_to_vectors_this_cpu_has(tmp_path: Path) -> None:
    """GCC computes a vector operation wider than the CPU's vectors piece by piece, often one element
    at a time: on an AMD EPYC with AVX2, the int8 copy of SmolLM2 took 71-77 ms a decode step at one
    row while the int8 kernel's sums were vectors of 16 floats, 8-13 ms since."""
    sources = (native.ATTENTION_SOURCE, *native.OTHER_SOURCES)
    result = subprocess.run(
        [
            "g++",
            *native.FLAGS,
            "-Wvector-operation-performance",
            *map(str, sources),
            "-o",
            str(tmp_path / "k.so"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "expanded piecewise" not in result.stderr


def random_norm(
    dtype: torch.dtype, width: int, seed: int, scale: float = 1.0
) -> tuple[RMSNorm, torch.Tensor]:
    """An RMSNorm of random weights and 64 rows of 3 tokens to normalise, in `dtype`."""
    generator = torch.Generator().manual_seed(seed)
    norm = RMSNorm(width, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(width, generator=generator).to(dtype)
    return norm, (torch.randn(64, 3, width, generator=generator) * scale).to(dtype)


def as_torch_operators(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """What `norm` gives where the kernel does not normalise: torch's norm, transformers' bits
    (tests/workers/models/test_llama.py)."""
    return norm.weight * F.rms_norm(x, (x.shape[-1],), eps=norm.eps)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_served_norm_gives_a_row_the_same_bits_in_any_batch_and_transformers_bits_nearly_always(
    dtype: torch.dtype,
) -> None:
    for width, scale in [(64, 0.01), (576, 1.0), (960, 30.0), (2048, 1.0)]:
        norm, x = random_norm(dtype, width, seed=width, scale=scale)
        with torch.inference_mode():
            assert native.normalizes(x, norm.weight)
            served = norm(x)
            assert torch.equal(served, native.rms_norm(x, norm.weight, norm.eps))  # through the kernel
            assert all(torch.equal(norm(x[row, token]), served[row, token])
                       for row in range(0, 64, 7) for token in range(3))  # fmt: skip
            reference = as_torch_operators(norm, x)
        # the same arithmetic but the order of the sum of squares: its two roundings (normed, then
        # scaled) may each go the other way, rarely
        assert (served != reference).float().mean() < 1e-3
        torch.testing.assert_close(served, reference, rtol=2 * torch.finfo(dtype).eps, atol=0)


def test_a_norm_runs_as_torch_operators_in_float32_and_under_autograd() -> None:
    """float32 greedy tokens stay transformers', and a fine-tune's forward differentiates the norm."""
    norm, x = random_norm(torch.float32, 64, seed=1)
    with torch.inference_mode():
        assert not native.normalizes(x, norm.weight)
    norm, x = random_norm(torch.bfloat16, 64, seed=1)
    assert not native.normalizes(x, norm.weight)  # autograd records this forward
    assert torch.equal(norm(x), as_torch_operators(norm, x))


@needs_kernel
def test_a_head_width_the_kernel_does_not_take_attends_as_torch_operators() -> None:
    assert_attends_as_torch_operators(HEAD_DIM + native.LANES // 2)


def int8_weights(channels: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 weights [channels, width] and bfloat16 scales [channels, groups] of them."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (channels, width), generator=generator, dtype=torch.int8)
    groups = -(-width // native.INT8_GROUP)
    return weight, (torch.rand(channels, groups, generator=generator) / 64).to(torch.bfloat16)


def scaled(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 `weight` [M, K] times `scales` [M, groups], each scale its group's, in float64."""
    return weight.double() * scales.double().repeat_interleave(native.INT8_GROUP, dim=1)[:, : weight.shape[1]]


@needs_kernel
@torch.inference_mode()
def test_an_int8_product_is_each_rows_dot_products_scaled_by_group_and_rounded_once() -> None:
    weight, scales = int8_weights(208, 90, seed=0)  # blocks past a whole number of tiles; a group of 26
    rows = torch.randn(7, 90, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert native.multiplies_int8(rows)
    assert torch.equal(native.unblocked(native.blocks_of(weight)), weight)
    got = native.int8_linear(rows, native.blocks_of(weight), native.blocks_of(scales))
    exact = rows.double() @ scaled(weight, scales).T
    # float32 sums carry about 2^-24 relative error, bfloat16 keeps 2^-8: the product rounded once
    # from them is the exact one rounded, but where the exact value lies right at a rounding boundary
    assert got.shape == (7, 208) and got.dtype == torch.bfloat16
    assert (got != exact.to(torch.bfloat16)).float().mean() < 0.01
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-6)


@needs_kernel
@torch.inference_mode()
def test_an_int8_product_gives_a_row_the_same_bits_alone_and_among_any_rows() -> None:
    weight, scales = int8_weights(208, 576, seed=2)
    blocks, scale_blocks = native.blocks_of(weight), native.blocks_of(scales)
    rows = torch.randn(11, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    alone = torch.cat([native.int8_linear(rows[i : i + 1], blocks, scale_blocks) for i in range(len(rows))])
    for start, end in [(0, 11), (0, 4), (3, 9), (5, 6), (2, 11)]:  # whole tiles of rows and parts
        got = native.int8_linear(rows[start:end].contiguous(), blocks, scale_blocks)
        assert torch.equal(got, alone[start:end])


@needs_kernel
@torch.inference_mode()
def test_an_int8_layer_of_any_width_multiplies_by_the_kernel_and_by_torch_where_autograd_records() -> None:
    rows = torch.randn(2, 5, 1000).to(torch.bfloat16)
    flat = rows.view(-1, 1000)
    for outputs in (96, 40):  # whole blocks of 16 channels, or padded with zero channels to them
        layer = Int8Linear(torch.nn.Linear(1000, outputs, bias=False))
        blocks = 6 if outputs == 96 else 3  # 40 outputs in 48 channels
        assert layer.whole_blocks == (outputs == 96) and layer.weight.shape == (blocks, 1000, 16)
        got = layer(rows).view(-1, outputs)
        by_kernel = native.int8_linear(flat, layer.weight, layer.scales)
        assert torch.equal(got, by_kernel[:, :outputs]) and not by_kernel[:, outputs:].any()
        with torch.enable_grad():  # an autograd-recorded forward (nothing in a served step) takes torch's
            assert not native.multiplies_int8(flat)
            by_torch = layer(rows).view(-1, outputs)
        assert torch.equal(by_torch, F.linear(flat, layer.dequantized()))
        torch.testing.assert_close(by_torch.float(), got.float(), rtol=0.02, atol=0.02)
