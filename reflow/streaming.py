"""A coalescing mailbox between a fast producer and a slower reader of one stream.

The reader gets whatever has accumulated since its last read, merged into one item, in
order; the first item is handed over as soon as it arrives. So a slow reader costs fewer
messages, never a reordering or a delay of the first token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """One pending item (merged from everything put since the last get) or a failure."""

    def __init__(self, merge: Callable[[T, T], None]):
        self._merge = merge  # merge(earlier, later) folds `later` into `earlier`
        self._pending: T | None = None
        self._failure: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: T) -> None:
        """Adds an item; merged into the pending one if the reader has not taken it yet."""
        if self._pending is None:
            self._pending = item
        else:
            self._merge(self._pending, item)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Makes the next get raise `error` once the pending item has been taken."""
        self._failure = error
        self._ready.set()

    async def get(self) -> T:
        """Everything put since the last get, merged; raises the failure after the last item."""
        await self._ready.wait()
        item, self._pending = self._pending, None
        if item is not None:
            if self._failure is None:
                self._ready.clear()
            return item
        assert self._failure is not None
        raise self._failure
