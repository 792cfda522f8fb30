"""Per-tenant quotas: concurrent streams, requests per minute and tokens per minute, each a limit
of the tenant's record (0 = none). `Quotas` is the seam; `LocalQuotas` keeps them in this process,
`SharedQuotas` (gateway/shared_quotas.py) in Redis for every replica at once.

Tokens are counted as OpenAI counts them for its limits: admission reserves the prompt's estimate
(a token per PROMPT_CHARS_PER_TOKEN characters) plus `max_tokens`, and the end of the stream
settles the reservation to the prompt and completion tokens the worker reports."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from gateway.tenants import TenantInfo
from reflow.errors import ResourceExhausted
from reflow.v1 import inference_pb2

PROMPT_CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb, the estimate its own rate limiter uses
STREAMS_RETRY_MS = 1000  # no clock says when a stream ends: a hint to come back in a second
QUOTAS = ("streams", "requests_per_minute", "tokens_per_minute")  # what a refusal names


@dataclass
class Charge:
    """What one admitted call costs in tokens: `reserved` at admission; the caller sets `tokens`
    as it learns better (0 until a token is sent, then the reservation, then the usage)."""

    reserved: int
    tokens: int = 0


class QuotaExceeded(ResourceExhausted):
    """A tenant's quota refused a call; `quota` is which one (of QUOTAS)."""

    def __init__(self, tenant: TenantInfo, quota: str, retry_after_ms: int, reserved: int = 0):
        limits = {
            "streams": f"its {tenant.max_concurrent_streams} concurrent streams; retry when one ends",
            "requests_per_minute": f"its {tenant.requests_per_minute} requests per minute",
            "tokens_per_minute": f"its {tenant.tokens_per_minute} tokens per minute (this request reserves "
            f"{reserved}: its prompt's characters / {PROMPT_CHARS_PER_TOKEN} plus max_tokens)",
        }
        retry = "" if quota == "streams" else f"; retry in {math.ceil(retry_after_ms / 100) / 10:.1f}s"
        super().__init__(
            f"tenant {tenant.name!r} is at {limits[quota]}{retry}", retry_after_ms=retry_after_ms
        )
        self.quota = quota


class Quotas:
    """Admits a tenant's calls within its limits, wherever the counts live."""

    def __init__(self, refused: Callable[[str], None] = lambda quota: None):
        self.refused = refused  # called with the quota's name on each refusal (a metric)

    @asynccontextmanager
    async def admit(self, tenant: TenantInfo, reserve_tokens: int = 0) -> AsyncIterator[Charge]:
        """Holds a stream slot, a request and `reserve_tokens` for the body (the Charge it yields
        says what to settle at the end); QuotaExceeded when a limit is reached."""
        charge = Charge(reserve_tokens)
        try:
            hold = await self.take(tenant, reserve_tokens)
        except QuotaExceeded as refusal:
            self.refused(refusal.quota)
            raise
        try:
            yield charge
        finally:
            await self.give_back(tenant, hold, charge.reserved - charge.tokens)

    async def take(self, tenant: TenantInfo, tokens: int) -> Any:
        """Takes a slot, a request and `tokens` at once, or nothing; returns what give_back needs."""
        raise NotImplementedError

    async def give_back(self, tenant: TenantInfo, hold: Any, refund_tokens: int) -> None:
        """Frees the slot of `hold` and credits `refund_tokens` (negative: charges more)."""
        raise NotImplementedError

    async def close(self) -> None:
        """Stops what runs in the background (nothing, unless the counts live elsewhere)."""


def estimated_tokens(request: inference_pb2.GenerateRequest, default_max_tokens: int) -> int:
    """What a Generate request reserves of a tokens-per-minute quota: its prompt's characters over
    PROMPT_CHARS_PER_TOKEN (the worker has not tokenized it yet) plus the most it may generate."""
    chars = prompt_chars(request)
    return math.ceil(chars / PROMPT_CHARS_PER_TOKEN) + (request.sampling.max_tokens or default_max_tokens)


def prompt_chars(request: inference_pb2.GenerateRequest) -> int:
    """The characters of a request's prompt, or of its conversation's roles and contents."""
    return len(request.prompt) + sum(len(m.role) + len(m.content) for m in request.messages)


def refill(level: float, elapsed_s: float, per_minute: int) -> float:
    """A bucket of `per_minute` capacity after `elapsed_s` more seconds of refilling."""
    return min(float(per_minute), level + elapsed_s * per_minute / 60.0)


def shortfall_ms(level: float, need: int, per_minute: int) -> int:
    """How long until a bucket at `level` holds `need` (never more than it can hold); 0 when it does."""
    want = min(need, per_minute)
    return 0 if level >= want else math.ceil((want - level) * 60_000 / per_minute)


class LocalQuotas(Quotas):
    """The counts in this process: limits hold per gateway replica (N replicas grant N times them)."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, refused: Callable[[str], None] = lambda q: None
    ):
        super().__init__(refused)
        self.clock = clock
        self._streams: dict[int, int] = defaultdict(int)
        self._buckets: dict[tuple[int, str], tuple[float, float]] = {}  # (tenant, quota) -> (level, at)

    async def take(self, tenant: TenantInfo, tokens: int) -> None:
        self.take_now(tenant, tokens)

    def take_now(self, tenant: TenantInfo, tokens: int) -> None:
        """take, without awaiting (so it is atomic on the event loop)."""
        if 0 < tenant.max_concurrent_streams <= self._streams[tenant.id]:
            raise QuotaExceeded(tenant, "streams", STREAMS_RETRY_MS)
        now = self.clock()
        takes = [("requests_per_minute", tenant.requests_per_minute, 1)]
        if tokens:
            takes.append(("tokens_per_minute", tenant.tokens_per_minute, tokens))
        levels = {}
        for quota, per_minute, need in takes:
            if per_minute > 0:
                levels[quota] = level = self._level(tenant, quota, per_minute, now)
                if wait_ms := shortfall_ms(level, need, per_minute):
                    raise QuotaExceeded(tenant, quota, wait_ms, tokens)
        for quota, _, need in takes:
            if quota in levels:
                self._buckets[tenant.id, quota] = (levels[quota] - need, now)
        self._streams[tenant.id] += 1

    async def give_back(self, tenant: TenantInfo, hold: None, refund_tokens: int) -> None:
        self._streams[tenant.id] -= 1
        if refund_tokens and tenant.tokens_per_minute > 0:
            now = self.clock()
            level = self._level(tenant, "tokens_per_minute", tenant.tokens_per_minute, now)
            self._buckets[tenant.id, "tokens_per_minute"] = (
                min(float(tenant.tokens_per_minute), level + refund_tokens),
                now,
            )

    def _level(self, tenant: TenantInfo, quota: str, per_minute: int, now: float) -> float:
        level, at = self._buckets.get((tenant.id, quota), (float(per_minute), now))
        return refill(level, now - at, per_minute)
