"""Per-tenant quotas in this gateway process: concurrent streams and requests per minute."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from gateway.tenants import TenantInfo
from reflow.errors import ResourceExhausted


class Quotas:
    """A token bucket for the request rate and a counter for open streams, per tenant.

    Limits hold per gateway replica: with N replicas a tenant gets up to N times them.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._streams: dict[int, int] = defaultdict(int)
        self._buckets: dict[int, tuple[float, float]] = {}  # tenant -> (tokens, last refill)

    @contextmanager
    def admit(self, tenant: TenantInfo) -> Iterator[None]:
        """Holds one stream slot for the body; ResourceExhausted when a limit is reached."""
        self._take_request(tenant)
        if self._streams[tenant.id] >= tenant.max_concurrent_streams:
            raise ResourceExhausted(
                f"tenant {tenant.name!r} already has {tenant.max_concurrent_streams} streams open; "
                "retry when one finishes"
            )
        self._streams[tenant.id] += 1
        try:
            yield
        finally:
            self._streams[tenant.id] -= 1

    def _take_request(self, tenant: TenantInfo) -> None:
        rate = tenant.requests_per_minute
        if rate <= 0:
            return
        now = self.clock()
        tokens, last = self._buckets.get(tenant.id, (float(rate), now))
        tokens = min(float(rate), tokens + (now - last) * rate / 60.0)
        if tokens < 1.0:
            wait = (1.0 - tokens) * 60.0 / rate
            self._buckets[tenant.id] = (tokens, now)
            raise ResourceExhausted(
                f"tenant {tenant.name!r} is over {rate} requests per minute; retry in {wait:.1f}s",
                retry_after_ms=int(wait * 1000) + 1,
            )
        self._buckets[tenant.id] = (tokens - 1.0, now)
