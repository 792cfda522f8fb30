"""The key cache against a flood of unknown keys: they never evict a tenant's key, and an address
that presents too many is refused without a lookup for any key L1 has not known valid, until its
minute ends, while tenants' keys keep working from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from gateway import auth as auth_module
from gateway.auth import Authenticator
from gateway.tenants import TenantInfo, create_tenant, find_by_key
from reflow.errors import ResourceExhausted, Unauthenticated
from tests.support.store import migrated_store


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Engine]:
    yield from migrated_store(f"sqlite:///{tmp_path / 'store.db'}")


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys the store is asked for, from here on."""
    asked: list[str] = []

    def counted(db: Engine, api_key: str) -> TenantInfo | None:
        asked.append(api_key)
        return find_by_key(db, api_key)

    monkeypatch.setattr(auth_module, "find_by_key", counted)
    return asked


async def test_unknown_keys_never_evict_a_tenant_from_the_cache(
    db: Engine, lookups: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Authenticator, "max_entries", 8)
    info, key = create_tenant(db, "acme")
    auth = Authenticator(db, ttl_s=60)
    assert await auth.authenticate(f"Bearer {key}") == info
    for i in range(20):  # more distinct unknown keys than the cache holds, under the throttle
        with pytest.raises(Unauthenticated):
            await auth.authenticate(f"Bearer unknown-key-{i:04d}-0123456789")
    del lookups[:]
    assert await auth.authenticate(f"Bearer {key}") == info
    assert lookups == []  # still in L1


async def test_an_address_past_its_unknown_keys_gets_no_lookup_until_its_minute_ends(
    db: Engine, lookups: list[str]
) -> None:
    info, key = create_tenant(db, "acme")
    _, unseen_key = create_tenant(db, "globex")
    clock = Clock()
    auth = Authenticator(db, ttl_s=10, clock=clock, failures_per_minute=3)
    scanner, neighbour = "203.0.113.7", "203.0.113.8"
    assert await auth.authenticate(f"Bearer {key}", scanner) == info  # known valid from here on
    for i in range(3):
        with pytest.raises(Unauthenticated):
            await auth.authenticate(f"Bearer guessed-key-{i:04d}-0123456789", scanner)
    assert len(lookups) == 4
    clock.now = 30.0
    with pytest.raises(ResourceExhausted, match="retry in 30 s") as refused:
        await auth.authenticate("Bearer guessed-key-0003-0123456789", scanner)
    assert refused.value.retry_after_ms == 30_000
    with pytest.raises(ResourceExhausted):  # a valid key this gateway never saw: no lookup either
        await auth.authenticate(f"Bearer {unseen_key}", scanner)
    assert len(lookups) == 4
    # the tenant behind the same address keeps its service, its L1 entry expired or not
    assert await auth.authenticate(f"Bearer {key}", scanner) == info
    assert len(lookups) == 5
    with pytest.raises(Unauthenticated):  # other addresses are counted apart
        await auth.authenticate("Bearer guessed-key-0004-0123456789", neighbour)
    clock.now = 60.0  # the scanner's minute is over
    assert (await auth.authenticate(f"Bearer {unseen_key}", scanner)).name == "globex"
