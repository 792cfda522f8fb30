"""Tenants, hashed keys, the auth cache and quotas."""

from __future__ import annotations

import contextlib

import pytest
from sqlalchemy import text

from gateway.auth import Authenticator
from gateway.metrics import OTHER_TENANTS, GatewayMetrics
from gateway.quotas import LocalQuotas, QuotaExceeded
from gateway.tenants import (
    Limits,
    TenantInfo,
    create_tenant,
    ensure_tenant,
    find_by_key,
    list_tenants,
    revoke_tenant,
)
from reflow.api_keys import hash_key
from reflow.errors import ResourceExhausted, Unauthenticated
from reflow.store.database import migrate, open_db


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_keys_are_stored_only_as_hashes(database_url: str) -> None:
    db = open_db(database_url)
    migrate(db)
    info, key = create_tenant(db, "acme")
    with db.connect() as connection:
        dump = " ".join(str(row) for row in connection.execute(text("SELECT * FROM tenants")))
    assert key not in dump and hash_key(key) in dump
    create_tenant(db, "byok", api_key="my-own-key-0123456789")
    assert [prefix for i, prefix, _ in list_tenants(db) if i.name == "byok"] == [""]  # nothing of it
    assert find_by_key(db, key) == info
    assert find_by_key(db, key + "x") is None
    with pytest.raises(ValueError, match="already exists"):
        create_tenant(db, "acme")
    assert revoke_tenant(db, "acme") == hash_key(key) and find_by_key(db, key) is None
    assert revoke_tenant(db, "acme") is None
    assert [(i.name, revoked) for i, _, revoked in list_tenants(db)] == [("acme", True), ("byok", False)]
    db.dispose()


def test_ensure_tenant_rekeys_but_never_revives_a_revoked_key(tmp_path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 's.db'}")
    migrate(db)
    info, retired = ensure_tenant(db, "default", "first-key-0123456789")
    assert retired is None and (info.max_concurrent_streams, info.tokens_per_minute) == (32, 0)
    info, retired = ensure_tenant(db, "default", "first-key-0123456789", Limits(4, 0, 1000))
    assert retired is None and info == TenantInfo(info.id, "default", 4, 0, 1000)  # new limits kept
    revoke_tenant(db, "default")
    with pytest.raises(ValueError, match="was revoked"):
        ensure_tenant(db, "default", "first-key-0123456789")
    _, retired = ensure_tenant(db, "default", "second-key-0123456789")
    assert retired == hash_key("first-key-0123456789")  # what gateways are told to forget
    assert find_by_key(db, "first-key-0123456789") is None
    assert find_by_key(db, "second-key-0123456789") is not None
    with pytest.raises(ValueError, match="at least 16"):
        create_tenant(db, "weak", api_key="short")
    with pytest.raises(ValueError, match="needs a name"):  # "" is the shared model's scope
        create_tenant(db, " ")
    with pytest.raises(ValueError, match="trains one of nothing, shared, own"):
        create_tenant(db, "unsure", trains="everything")


async def test_lookups_are_cached_for_the_ttl(tmp_path) -> None:
    db = open_db(f"sqlite:///{tmp_path / 's.db'}")
    migrate(db)
    _, key = create_tenant(db, "acme")
    clock = Clock()
    auth = Authenticator(db, ttl_s=10, clock=clock)
    assert (await auth.authenticate(f"Bearer {key}")).name == "acme"
    revoke_tenant(db, "acme")
    clock.now = 9.9
    assert (await auth.authenticate(f"Bearer {key}")).name == "acme"  # served from the cache
    clock.now = 10.1
    with pytest.raises(Unauthenticated):
        await auth.authenticate(f"Bearer {key}")


async def test_stream_quota_and_rate_limit() -> None:
    clock = Clock()
    quotas = LocalQuotas(clock)
    tenant = TenantInfo(1, "acme", max_concurrent_streams=2, requests_per_minute=3)
    async with quotas.admit(tenant), quotas.admit(tenant):
        with pytest.raises(QuotaExceeded, match="its 2 concurrent streams; retry when one ends") as refused:
            async with quotas.admit(tenant):
                pass
        assert refused.value.quota == "streams"  # and, refused, it took no request of the rate
    async with quotas.admit(tenant):
        pass
    with pytest.raises(ResourceExhausted, match=r"3 requests per minute; retry in 20\.0s"):
        async with quotas.admit(tenant):
            pass
    clock.now = 20.0  # one request's worth refilled
    async with quotas.admit(tenant):
        pass
    other = TenantInfo(2, "other", max_concurrent_streams=0, requests_per_minute=0)  # no limits at all
    async with contextlib.AsyncExitStack() as streams:
        for _ in range(100):
            await streams.enter_async_context(quotas.admit(other))


def test_series_by_tenant_stay_bounded() -> None:
    metrics = GatewayMetrics(max_tenants=2)
    assert [metrics.tenant(t) for t in ("acme", "globex", "initech", "acme", "hooli")] == [
        "acme", "globex", OTHER_TENANTS, "acme", OTHER_TENANTS,
    ]  # fmt: skip
