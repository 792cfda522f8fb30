"""Quotas every gateway replica shares, kept in Redis: each check-and-take is one Lua script (no
read-then-write race between replicas), on Redis's clock (no skew between them).

A tenant's open streams are a sorted set of leases that their gateway renews while they run: a
stream that ends gives its slot back at once, a gateway that dies gives its back when the leases
run out. Rates are token buckets in hashes that expire once they would be full again. While Redis
is unreachable, each replica enforces the same limits on its own (LocalQuotas)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass

from gateway.quotas import LocalQuotas, QuotaExceeded, Quotas
from gateway.shared_level import OUTAGE, SharedLevel
from gateway.tenants import TenantInfo

logger = logging.getLogger(__name__)

# The buckets' arithmetic is gateway/quotas.py's (refill, shortfall_ms), in milliseconds.
_BUCKETS = """
local now_s = redis.call('TIME')
local now = now_s[1] * 1000 + math.floor(now_s[2] / 1000)
local function level(key, per_minute)
  local state = redis.call('HMGET', key, 'level', 'at')
  if not state[1] then return per_minute end
  return math.min(per_minute, tonumber(state[1]) + (now - tonumber(state[2])) * per_minute / 60000)
end
local function store(key, value, per_minute)
  redis.call('HSET', key, 'level', value, 'at', now)
  redis.call('PEXPIRE', key, math.ceil((per_minute - value) * 60000 / per_minute) + 1000)
end
"""

# KEYS: streams, requests bucket, tokens bucket. ARGV: member, lease ms, streams limit,
# requests per minute, tokens per minute, tokens to take. Returns {quota refused or '', retry ms}.
TAKE = (
    _BUCKETS
    + """
local member, lease = ARGV[1], tonumber(ARGV[2])
local streams, rpm, tpm, tokens = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
if streams > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= streams then return {'streams', 0} end
end
local requests, budget
if rpm > 0 then
  requests = level(KEYS[2], rpm)
  if requests < 1 then return {'requests_per_minute', math.ceil((1 - requests) * 60000 / rpm)} end
end
if tpm > 0 and tokens > 0 then
  budget = level(KEYS[3], tpm)
  local want = math.min(tokens, tpm)
  if budget < want then return {'tokens_per_minute', math.ceil((want - budget) * 60000 / tpm)} end
end
if streams > 0 then
  redis.call('ZADD', KEYS[1], now + lease, member)
  redis.call('PEXPIRE', KEYS[1], lease * 2)
end
if requests then store(KEYS[2], requests - 1, rpm) end
if budget then store(KEYS[3], budget - tokens, tpm) end
return {'', 0}
"""
)

# KEYS: streams, tokens bucket. ARGV: member, tokens per minute, tokens to credit (may be < 0).
GIVE_BACK = (
    _BUCKETS
    + """
redis.call('ZREM', KEYS[1], ARGV[1])
local tpm, credit = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and credit ~= 0 then store(KEYS[2], math.min(tpm, level(KEYS[2], tpm) + credit), tpm) end
return 0
"""
)

# KEYS: streams. ARGV: lease ms, then the members this gateway holds there. Renews their leases.
RENEW = """
local now_s = redis.call('TIME')
local expiry = now_s[1] * 1000 + math.floor(now_s[2] / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return 0
"""


@dataclass(frozen=True)
class Hold:
    """Where an admitted call's slot is: a lease in Redis (`member`) or LocalQuotas (None)."""

    member: str | None


class SharedQuotas(Quotas):
    """Quotas in Redis for all replicas; per replica while it is unreachable."""

    def __init__(self, shared: SharedLevel, lease_s: float, local: LocalQuotas):
        super().__init__(local.refused)
        self.shared = shared
        self.lease_ms = max(1, round(lease_s * 1000))
        self.local = local
        self._take = shared.client.register_script(TAKE)
        self._give_back = shared.client.register_script(GIVE_BACK)
        self._renew = shared.client.register_script(RENEW)
        replica = uuid.uuid4().hex[:12]  # drawn once: every lease of this replica carries it
        self._ids = (f"{replica}-{n}" for n in itertools.count())
        self._held: dict[int, set[str]] = defaultdict(set)  # tenant id -> members renewed here
        self._renewal: asyncio.Task[None] | None = None
        self._giving_back: set[asyncio.Future[None]] = set()  # held here only while they run

    def _key(self, tenant_id: int, counts: str) -> str:
        """`streams`, `requests` or `tokens` of a tenant; its id in braces is the key's hash tag, so
        in a Redis Cluster a tenant's keys share the slot a script needs."""
        return self.shared.key("tenant", f"{{{tenant_id}}}", counts)

    async def take(self, tenant: TenantInfo, tokens: int) -> Hold:
        if self.shared.available:
            member = next(self._ids)
            try:
                quota, retry_ms = await self._take(
                    keys=[self._key(tenant.id, counts) for counts in ("streams", "requests", "tokens")],
                    args=[member, self.lease_ms, tenant.max_concurrent_streams, tenant.requests_per_minute,
                          tenant.tokens_per_minute, tokens],
                )  # fmt: skip
            except OUTAGE as error:
                self.shared.failed(error)
            else:
                if quota:
                    raise QuotaExceeded(tenant, quota.decode(), int(retry_ms) or 1000, tokens)
                self._held[tenant.id].add(member)
                self._start_renewing()
                return Hold(member)
        self.local.take_now(tenant, tokens)
        return Hold(None)

    async def give_back(self, tenant: TenantInfo, hold: Hold, refund_tokens: int) -> None:
        if hold.member is None:
            await self.local.give_back(tenant, None, refund_tokens)
            return
        self._held[tenant.id].discard(hold.member)
        if not self._held[tenant.id]:
            del self._held[tenant.id]
        if not self.shared.available:
            return  # the lease runs out by itself
        keys = [self._key(tenant.id, "streams"), self._key(tenant.id, "tokens")]
        # shielded: a stream ends this way when its client cancels it, and a cancelled give-back
        # would hold the slot until its lease ran out
        giving_back = asyncio.ensure_future(
            self._give_back_now(keys, [hold.member, tenant.tokens_per_minute, refund_tokens])
        )
        self._giving_back.add(giving_back)
        giving_back.add_done_callback(self._giving_back.discard)
        await asyncio.shield(giving_back)

    async def _give_back_now(self, keys: list[str], args: list[str | int]) -> None:
        try:
            await self._give_back(keys=keys, args=args)
        except OUTAGE as error:
            self.shared.failed(error)

    def _start_renewing(self) -> None:
        if self._renewal is None or self._renewal.done():
            self._renewal = asyncio.get_running_loop().create_task(self._renew_leases())

    async def _renew_leases(self) -> None:
        """Renews this replica's leases three times per lease, while it holds any."""
        while self._held:
            await asyncio.sleep(self.lease_ms / 3000)
            if not self.shared.available:
                continue
            try:
                async with self.shared.client.pipeline(transaction=False) as pipe:
                    for tenant_id, members in list(self._held.items()):
                        streams = self._key(tenant_id, "streams")
                        await self._renew(keys=[streams], args=[self.lease_ms, *members], client=pipe)
                    await pipe.execute()
            except OUTAGE as error:
                self.shared.failed(error)

    async def close(self) -> None:
        """Finishes the give-backs under way and stops renewing (what this replica still holds
        then runs out with its leases)."""
        await asyncio.gather(*self._giving_back)
        if self._renewal is not None:
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
