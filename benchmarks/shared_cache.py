"""What the shared level (Redis) adds to each request's admission, against L1 alone: the key
lookup and the quota check-and-take and give-back a gateway makes per call, side by side in one run.

    .venv/bin/python benchmarks/shared_cache.py [--redis redis://127.0.0.1:6379/0] [--requests 2000]

Three setups, run in alternating rounds so drift on a shared machine falls on all of them, each on
the real objects a gateway uses (Authenticator, LocalQuotas, SharedQuotas), a SQLite store and
the Redis at --redis (keys under a prefix of the run's own, deleted after):
  * `L1 only`: what a gateway without REFLOW_REDIS_URL does (the key in its own cache, quotas in
    its memory);
  * `L1 + L2`: a replica sharing Redis in the common case (the key in L1, the quota scripts in
    Redis: one round trip to take, one to give back);
  * `L2 lookup`: the same with every key lookup missing L1 and found in L2 (a replica's first
    request with a key, or the first after the L1 TTL).
Prints the p50 and p99 (µs) of what a request waits for before its first token (the key and the
quota's take) and of the give-back after its last, and what each adds to `L1 only`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.auth import Authenticator
from gateway.quotas import LocalQuotas, Quotas
from gateway.shared_level import RedisConfig, SharedLevel
from gateway.shared_quotas import SharedQuotas
from gateway.tenants import Limits, create_tenant
from reflow.store.database import migrate, open_db

Admission = Callable[[], Awaitable[tuple[float, float]]]


def admission(auth: Authenticator, quotas: Quotas, header: str) -> Admission:
    """One request's admission: the key and a stream's quota taken (what the request waits for
    before its first token), then the quota given back (after its last); each in µs."""

    async def admit() -> tuple[float, float]:
        started = time.perf_counter()
        tenant = await auth.authenticate(header)
        async with quotas.admit(tenant, 64) as charge:
            admitted = time.perf_counter()
            charge.tokens = 40
        return (admitted - started) * 1e6, (time.perf_counter() - admitted) * 1e6

    return admit


def percentile(samples: list[float], q: float) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[q - 1] if q < 100 else max(samples)


async def main(redis_url: str, requests: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = open_db(f"sqlite:///{Path(tmp) / 'store.db'}")
        migrate(db)
        # every quota counted, none refusing: what is measured is admission, not refusal
        _, key = create_tenant(db, "bench", limits=Limits(1000, 10**9, 10**9))
        prefix = f"reflow-bench:{uuid.uuid4().hex[:8]}:"
        config = RedisConfig(redis_url, prefix, timeout_s=0.5, key_ttl_s=60)
        levels = [SharedLevel(config), SharedLevel(config)]
        header = f"Bearer {key}"
        shared_quotas = [SharedQuotas(level, 15, LocalQuotas()) for level in levels]
        setups = {
            "L1 only": admission(Authenticator(db, 60), LocalQuotas(), header),
            "L1 + L2": admission(Authenticator(db, 60, shared=levels[0]), shared_quotas[0], header),
            "L2 lookup": admission(Authenticator(db, 0, shared=levels[1]), shared_quotas[1], header),
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in setups}
        for admit in setups.values():  # warm: the key in L1 and L2, the scripts loaded
            for _ in range(50):
                await admit()
        for _ in range(rounds):
            for name, admit in setups.items():
                for _ in range(requests // rounds):
                    samples[name].append(await admit())
        for quotas, level in zip(shared_quotas, levels, strict=True):
            await quotas.close()
            assert level.available, "Redis stopped answering during the run"
            await level.close()
        with redis.Redis.from_url(redis_url) as client:
            for stale in client.scan_iter(match=f"{prefix}*"):
                client.delete(stale)
        db.dispose()

    print(f"{requests} requests per setup; µs (and added to `L1 only`) at p50 / p99:")
    print(f"{'setup':<11} {'before the first token (key + take)':>38} {'after the last (give back)':>30}")
    base = [[percentile([sample[i] for sample in samples["L1 only"]], q) for q in (50, 99)] for i in (0, 1)]
    for name, values in samples.items():
        cells = []
        for i in (0, 1):
            p50, p99 = (percentile([sample[i] for sample in values], q) for q in (50, 99))
            cells.append(f"{p50:.0f} ({p50 - base[i][0]:+.0f}) / {p99:.0f} ({p99 - base[i][1]:+.0f})")
        print(f"{name:<11} {cells[0]:>38} {cells[1]:>30}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(main(args.redis, args.requests, args.rounds))
