"""Attention over the paged cache: the grouped kernel bfloat16 and float16 decode with on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import eager_attention_forward

from workers.models.kv_cache import KeyMask, fused_attention, grouped_attention

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5


def attention_inputs(
    rows: int, queries: int, keys: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeyMask]:
    """q [B, H, T, D], keys and values [B, KVH, S, D] (transposed views, as the cache gathers them),
    and a causal mask ([B, 1, T, S] allowed) whose rows end at different positions."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, queries, HEADS, HEAD_DIM, generator=generator).to(dtype).transpose(1, 2)
    k = torch.randn(rows, keys, KV_HEADS, HEAD_DIM, generator=generator).to(dtype).transpose(1, 2)
    v = torch.randn(rows, keys, KV_HEADS, HEAD_DIM, generator=generator).to(dtype).transpose(1, 2)
    last = torch.randint(queries - 1, keys, (rows,), generator=generator)  # each row's last position
    query_positions = last[:, None] - torch.arange(queries - 1, -1, -1)  # [B, T]
    mask = torch.arange(keys)[None, None, :] <= query_positions[:, :, None]
    return q, k, v, KeyMask.of(mask[:, None])


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_grouped_attention_computes_what_transformers_eager_attention_does(
    dtype: torch.dtype, queries: int
) -> None:
    q, k, v, mask = attention_inputs(3, queries, 48, dtype)
    module = nn.Module()
    module.num_key_value_groups = HEADS // KV_HEADS  # type: ignore[assignment]  # what eager reads
    additive = torch.zeros(mask.allowed.shape, dtype=dtype).masked_fill(~mask.allowed, torch.finfo(dtype).min)
    expected, _ = eager_attention_forward(module, q, k, v, additive, SCALE)  # [B, T, H, D]
    got = grouped_attention(q, k, v, mask, SCALE)
    torch.testing.assert_close(got.transpose(1, 2), expected, rtol=0, atol=0)


def test_grouped_attention_agrees_with_torch_fused_kernel_in_float32() -> None:
    q, k, v, mask = attention_inputs(4, 3, 64, torch.float32)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, SCALE), fused_attention(q, k, v, mask, SCALE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_row_attends_to_the_same_bits_alone_and_beside_longer_rows(dtype: torch.dtype) -> None:
    q, k, v, mask = attention_inputs(5, 1, 80, dtype, seed=1)
    batched = grouped_attention(q, k, v, mask, SCALE)
    for row in range(5):
        held = int(mask.allowed[row, 0, -1].sum())  # keys the row attends to
        width = -(-held // 16) * 16  # alone it reads only its own blocks
        alone = grouped_attention(
            q[row : row + 1], k[row : row + 1, :, :width], v[row : row + 1, :, :width],
            KeyMask.of(mask.allowed[row : row + 1, :, :, :width]), SCALE,
        )  # fmt: skip
        assert torch.equal(alone, batched[row : row + 1])
