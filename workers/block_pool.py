"""The KV blocks of one version's pool: which are free, which sequences hold, and which keep a
prompt prefix's keys and values for the next request that starts with it (prefix caching).

A full block of a prompt is known by a hash of its tokens chained to the hashes of the blocks
before it, salted with the adapter it was computed through and the request's cache salt (the
gateway's tenant), so a block is found again only by a prompt that starts with exactly the same
tokens through exactly the same weights, for the same tenant (a new version has a pool of its own:
a hot-swap never serves an old version's keys). A block stays cached after the last sequence
holding it ends, and is evicted, least recently used first, only when a block is needed: cached
blocks nobody holds count as free, so caching never makes a request wait.

Only prompt blocks are cached, as prefill computed them. A conversation's next turn resends the
answer it got, whose keys decode steps computed one token at a time: those would come back in
other bits than a prefill of the same tokens gives (float32 on MKL), so whether a turn hit the
cache would change its output. The next turn's prefill computes them, and the turn after reuses them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from workers.models.kv_cache import SCRATCH_BLOCK


def block_hashes(tokens: Sequence[int], block_size: int, salt: str) -> list[bytes]:
    """The hashes of the full blocks of `tokens`, each chained to the ones before it."""
    parent = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = array("q", tokens[start : start + block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """Free, held and cached blocks of a pool of `n_blocks` (the scratch block never handed out).

    Not thread-safe: the scheduler calls it under its lock.
    """

    def __init__(self, n_blocks: int):
        self._free = [b for b in range(n_blocks - 1, -1, -1) if b != SCRATCH_BLOCK]
        self._holders: dict[int, int] = {}  # block -> sequences holding it (held blocks only)
        self._cached: dict[bytes, int] = {}  # hash -> the block with those keys and values
        self._hash_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody: least recent first

    @property
    def available(self) -> int:
        """Blocks a sequence can take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def cached(self) -> int:
        """Blocks holding a cached prefix, held or not."""
        return len(self._cached)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (to `hold`)."""
        blocks: list[int] = []
        for digest in hashes:
            block = self._cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def idle_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` nobody holds: holding them takes them from `available`."""
        return sum(1 for b in blocks if b in self._idle)

    def hold(self, blocks: Sequence[int]) -> None:
        """A sequence maps cached `blocks` into its table."""
        for block in blocks:
            self._idle.pop(block, None)
            self._holders[block] = self._holders.get(block, 0) + 1

    def take(self) -> int:
        """A block for new keys and values: a free one, else the least recently used idle one's."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
        self._holders[block] = 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence lets go of its blocks (in table order). Cached ones its last holder lets go of
        stay, behind every block idle before them and tail first (a prefix outlives its continuations)."""
        for block in reversed(blocks):
            self._holders[block] -= 1
            if self._holders[block]:
                continue
            del self._holders[block]
            if block in self._hash_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def register(self, block: int, digest: bytes) -> None:
        """Caches a held block whose keys and values prefill has just written, unless the same
        prefix is cached already (two requests with it prefilled side by side)."""
        if digest not in self._cached:
            self._cached[digest] = block
            self._hash_of[block] = digest

    def forget(self) -> None:
        """Empties the cache: the blocks nobody holds are free, and the held ones will be."""
        self._free.extend(self._idle)
        self._idle.clear()
        self._cached.clear()
        self._hash_of.clear()
