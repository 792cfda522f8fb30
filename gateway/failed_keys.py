"""Unknown API keys counted per client address: past REFLOW_AUTH_FAILURES_PER_MINUTE within a
minute, the address is refused a lookup until that minute ends, so guessing keys costs the store
nothing."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from reflow.errors import ResourceExhausted


class FailedKeys:
    """Failed key checks per client address, in a window that opens at an address's first failure."""

    window_s = 60.0
    max_addresses = 65_536  # bounds memory under failures from many addresses (the oldest go first)

    def __init__(self, per_window: int, clock: Callable[[], float] = time.monotonic):
        self.per_window = per_window
        self.clock = clock
        # address -> (when its window opened, failures in it), the least recently failed first
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def check(self, address: str) -> None:
        """ResourceExhausted, saying when to retry, while `address` is past the limit."""
        opened, failures = self._windows.get(address, (0.0, 0))
        left_s = opened + self.window_s - self.clock()
        if failures >= self.per_window and left_s > 0:
            raise ResourceExhausted(
                f"{failures} unknown API keys from this address within a minute; retry in "
                f"{math.ceil(left_s)} s with a valid key (`reflow tenants create` makes one)",
                retry_after_ms=math.ceil(left_s * 1000),
            )

    def failed(self, address: str) -> None:
        """Counts a failed key check of `address`."""
        now = self.clock()
        opened, failures = self._windows.pop(address, (now, 0))
        if opened + self.window_s <= now:
            opened, failures = now, 0
        self._windows[address] = (opened, failures + 1)
        while len(self._windows) > self.max_addresses:
            self._windows.popitem(last=False)
