"""How one forward turns its queries and keys by their positions (rotary embeddings): `Rotation`,
made by the decoder from its table of each position's cos and sin (`llama.rope_table`), applied by
attention (`kv_cache.paged_attention`: as torch operators, or inside the native kernel)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Rotation:
    """What turns one forward's q and k: `table` [B, T, 2, D], the cos and sin (signed) of each
    token's position in the dtype they turn in (what the native kernel reads), and `cos` and `sin`
    [B, T, 1, D], its two halves as they broadcast over heads (made once a forward, not a layer);
    the features turned together are halves (transformers' rotate_half), or adjacent `pairs`
    (gpt-fast's apply_rotary_emb)."""

    table: Tensor
    cos: Tensor
    sin: Tensor
    pairs: bool

    @classmethod
    def of(cls, table: Tensor, pairs: bool) -> Rotation:
        """The rotation of the positions whose cos and sin `table` [B, T, 2, D] holds."""
        return cls(table, table[:, :, None, 0], table[:, :, None, 1], pairs)

    def __call__(self, x: Tensor) -> Tensor:
        """x [B, T, H, D] turned: x * cos + x turned a quarter * sin, in cos's dtype. x turned a
        quarter is x with the features of each half (or pair) swapped, each negated where sin is:
        (-a) * s and a * (-s) are the same bits."""
        y = x if x.dtype == self.cos.dtype else x.to(self.cos.dtype)
        if self.pairs:
            swapped = y.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:
            swapped = y.roll(y.shape[-1] // 2, -1)
        turned = y * self.cos + swapped * self.sin
        return turned if turned.dtype == x.dtype else turned.to(x.dtype)
