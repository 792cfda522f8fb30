"""Keys and values in fixed-size blocks that sequences take as they grow, and attention over them.

Every model keeps its cache here: one pool of `n_blocks` blocks of `block_size` token slots per
layer. A sequence owns a list of blocks (its block table); a forward pass gets a `CacheView` that
says where each new token's key and value go and which blocks each row attends to, so attention
costs in proportion to the tokens the batch's sequences hold, never to the model's context.
Block 0 is scratch: padding rows and padding tokens write there and nothing real reads it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from workers.models import native
from workers.models.rotary import Rotation

BLOCK_SIZE = 16  # token slots per block, as vLLM's default
SCRATCH_BLOCK = 0


class PagedKVCache:
    """The pool: keys and values of `n_blocks * block_size` token slots in every layer."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int = BLOCK_SIZE,
    ):
        if n_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (one is scratch), got {n_blocks}")
        shape = (n_layers, n_blocks * block_size, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, slots, KVH, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.n_blocks = n_blocks
        self.block_size = block_size
        self._layers = [torch.tensor(i, device=device) for i in range(n_layers)]  # index_put_'s

    @property
    def reads_packed(self) -> bool:
        """Whether forwards over this pool may be laid out as `packed_view`s: where the native
        kernel attends over its keys, outside a compiled step."""
        return native.attends(self.k)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Stores one layer's keys and values [N, KVH, D] in token `slots` [N]: by index_put_ on
        the pool itself, never on a layer's view of it, which a compiled step would write by
        copying the whole pool every step."""
        at = (self._layers[layer], slots)
        self.k.index_put_(at, k)
        self.v.index_put_(at, v)

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """What one token's keys and values take across the layers."""
        return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize

    def view(
        self,
        tables: Sequence[Sequence[int]],
        positions: Sequence[Sequence[int]],
        device: torch.device,
        min_blocks: int = 1,
    ) -> CacheView:
        """Where one forward's tokens go: row b holds tokens at `positions[b]` (-1 = padding) of
        the sequence whose blocks are `tables[b]` (empty = a padding row); every row reads at
        least `min_blocks` blocks (scratch past its own, which the mask hides)."""
        width = max(len(row) for row in positions)
        padded = torch.tensor([[*row, *[-1] * (width - len(row))] for row in positions])  # [B, T]
        return self._view(tables, padded, [width] * len(tables), device, min_blocks)

    def packed_view(
        self, tables: Sequence[Sequence[int]], positions: Sequence[Sequence[int]], device: torch.device
    ) -> CacheView:
        """Where one forward's tokens go when each is a row of its own ([N, 1]) and each sequence's
        rows follow one another: sequence b's tokens at `positions[b]`, in its blocks `tables[b]`.
        Only the native kernel attends over such a view (`CacheView.packed`)."""
        flat = torch.tensor([position for row in positions for position in row])[:, None]  # [N, 1]
        return self._view(tables, flat, [len(row) for row in positions], device)

    def _view(
        self,
        tables: Sequence[Sequence[int]],
        positions: Tensor,
        lengths: list[int],
        device: torch.device,
        min_blocks: int = 1,
    ) -> CacheView:
        """The view of tokens at `positions` (any shape, -1 = padding), the first lengths[0] of them
        (in row-major order) sequence 0's, the next lengths[1] sequence 1's, and so on."""
        bs = self.block_size
        n_read = -(-(int(positions.max()) + 1) // bs)  # blocks every sequence reads: the longest's
        width = max(n_read, min_blocks)
        table = torch.tensor(
            [[*blocks[:n_read], *[SCRATCH_BLOCK] * (width - len(blocks[:n_read]))] for blocks in tables]
        )  # [R, width]
        owner = torch.arange(len(tables)).repeat_interleave(torch.tensor(lengths)).view(positions.shape)
        valid = positions >= 0
        at = positions.clamp(min=0)
        write = torch.where(valid, table[owner, at // bs] * bs + at % bs, SCRATCH_BLOCK * bs)
        starts = torch.tensor([0, *itertools.accumulate(lengths)])
        return CacheView(
            positions=at.to(device),
            write=write.to(device),
            read=table.to(device),
            starts=starts.to(device),
            block_size=bs,
        )


@dataclass(frozen=True)
class CacheView:
    """One forward's place in the pool: positions and write slots [B, T], the blocks each
    sequence reads [R, N] (its block table, cut or padded with scratch to the longest row's N
    blocks) and where each sequence's tokens start among the forward's B*T tokens [R + 1]. A row
    is one sequence's (R = B, starts every T tokens) unless the view is `packed`."""

    positions: Tensor  # [B, T]: each token's position in its sequence (0 for padding)
    write: Tensor  # [B, T]: the slot its key and value go to
    read: Tensor  # [R, N]: the blocks holding key positions 0..N*block_size-1 of each sequence
    starts: Tensor  # [R + 1]: sequence r's tokens are the forward's starts[r] to starts[r + 1]
    block_size: int

    @property
    def packed(self) -> bool:
        """Whether the rows are tokens, one each, a sequence's side by side (`packed_view`)."""
        return self.read.shape[0] != self.positions.shape[0]

    def mask(self, window: int = 0) -> KeyMask:
        """Which keys each query attends to: its own and earlier positions (the last `window`
        of them when the model attends over a sliding window)."""
        keys = self.read.shape[1] * self.block_size
        key_pos = torch.arange(keys, device=self.read.device)[None, None, :]  # [1, 1, S]
        query_pos = self.positions[:, :, None]  # [B, T, 1]
        allowed = key_pos <= query_pos
        if window:
            allowed &= key_pos > query_pos - window
        return KeyMask.of(allowed[:, None])


@dataclass(frozen=True)
class KeyMask:
    """A forward's attention mask, made once for all its layers in the two shapes they read."""

    allowed: Tensor  # [B, 1, T, S]: the keys each query attends to (fused_attention's mask)
    hidden: Tensor  # [B, 1, 1, T, S]: the others, as grouped_attention's [B, KVH, G, T, S] scores hide

    @classmethod
    def of(cls, allowed: Tensor) -> KeyMask:
        """The mask that attends to `allowed` ([B, 1, T, S])."""
        return cls(allowed, ~allowed[:, :, None])


def paged_attention(
    cache: PagedKVCache,
    layer: int,
    view: CacheView,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: KeyMask | None,
    rotation: Rotation,
    window: int = 0,
    scale: float | None = None,
) -> Tensor:
    """Turns q and k by their positions (`rotation`), writes the new keys and values, then attends
    over each sequence's cached ones (the last `window` of them, if set).

    q: [B, T, H, D]; k, v: [B, T, KVH, D] with H a multiple of KVH (grouped-query attention), as
    the projections lay them out; mask: `view.mask(window)`'s (None for a packed view); returns
    [B, H, T, D].

    On the CPU every dtype attends through the native kernel where it builds and takes the head
    width (`native.attends`), except in a compiled step; else as torch operators
    (`grouped_attention` in bfloat16 and float16, `fused_attention` in float32 and on CUDA), which
    read padded views only. The kernel turns q and k itself, with the same bits as `rotation`'s
    operators, where they turn by halves in their own dtype (as transformers turns them).
    """
    b, t, kv_heads, d = k.shape
    if not torch.compiler.is_compiling() and native.attends(q):
        rope = rotation.table if not rotation.pairs and rotation.table.dtype == q.dtype else None
        if rope is None:  # pairs, turned in float32 (the built-in model's): as torch operators
            q, k = rotation(q), rotation(k)
        out = native.paged_attention(
            cache.k[layer], cache.v[layer], cache.block_size, view.write.view(-1), view.read,
            view.positions.view(-1), view.starts, q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
            None if rope is None else rope.flatten(0, 1), window, d**-0.5 if scale is None else scale,
        )  # fmt: skip
        return out.view(b, t, -1, d).transpose(1, 2)
    if mask is None:
        raise ValueError("a packed view is attended by the native kernel only")
    q, k = rotation(q), rotation(k)
    slots = view.write.reshape(-1)  # [B*T]
    cache.write(layer, slots, k.reshape(b * t, kv_heads, d), v.reshape(b * t, kv_heads, d))
    blocks = view.read.reshape(-1)  # [B*N]: whole blocks are gathered, far faster than token slots
    shape = (cache.n_blocks, cache.block_size, kv_heads, d)
    keys = cache.k[layer].view(shape).index_select(0, blocks).view(b, -1, kv_heads, d).transpose(1, 2)
    values = cache.v[layer].view(shape).index_select(0, blocks).view(b, -1, kv_heads, d).transpose(1, 2)
    # [B, KVH, S, D]; each group of query heads reads its key/value head in place
    q = q.transpose(1, 2)  # [B, H, T, D]
    if q.device.type == "cpu" and q.dtype != torch.float32:
        return grouped_attention(q, keys, values, mask, scale)
    return fused_attention(q, keys, values, mask, scale)


def fused_attention(q: Tensor, keys: Tensor, values: Tensor, mask: KeyMask, scale: float | None) -> Tensor:
    """torch's fused kernel (transformers' `sdpa` attention): on CUDA, and for float32 on the CPU
    where the native kernel does not attend."""
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask.allowed, scale=scale, enable_gqa=True
    )


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: KeyMask, scale: float | None) -> Tensor:
    """Attention as three plain operators, as transformers' eager attention computes it (scores in
    the query's dtype, softmax in float32), each key/value head serving its group of query heads
    in place (never repeated): q [B, H, T, D], keys and values [B, KVH, S, D].

    For bfloat16 and float16 on the CPU where the native kernel does not attend (`native.attends`:
    no C++ compiler, a head width it does not take, a compiled step). There torch's fused kernel
    costs ~70 us a row at one query a row (bfloat16, 9 heads of 64, 128 keys: 970 us for 16 rows
    against 170 us here), and decode steps are made of such rows (benchmarks/decode_attention.py).
    It serves prefill too, so
    that a token's attention is one computation however the tokens around it are batched (alone,
    in a batch, drafted or not)."""
    b, heads, t, d = q.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    keys, values = keys.reshape(b * kv_heads, s, d), values.reshape(b * kv_heads, s, d)
    scores = torch.bmm(q.reshape(b * kv_heads, group * t, d), keys.transpose(1, 2))
    scores.mul_(d**-0.5 if scale is None else scale)  # [B*KVH, G*T, S]
    scores.view(b, kv_heads, group, t, s).masked_fill_(mask.hidden, float("-inf"))
    weights = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(weights, values).view(b, heads, t, d)
