"""The two-level key cache in a real Redis: each Authenticator here is one gateway replica's. A
lookup goes L1 → L2 → store; a revocation announced through Redis reaches every replica at once;
an outage leaves L1 and the store serving, and a replica back on Redis forgets what it may have
missed. What L2 holds is a tenant only under a gateway's signature, so write access to Redis is
no one's identity; the shared level runs as an ACL user of Redis, and over TLS (`rediss://`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from sqlalchemy import Engine

from gateway.auth import KEY_ENTRY, REVOCATIONS, Authenticator, announce_key_change
from gateway.quotas import LocalQuotas
from gateway.shared_level import shared_key
from gateway.shared_quotas import SharedQuotas
from gateway.tenants import TenantInfo, create_tenant, revoke_tenant
from reflow.api_keys import hash_key
from reflow.errors import Unauthenticated
from reflow.serving import free_port
from reflow.store.database import migrate, open_db
from tests.support.certificates import tls_files
from tests.support.redis import RedisServer, SharedRedis
from tests.support.waiting import eventually, wait_for


@pytest.fixture
def db(tmp_path: Path) -> Engine:
    db = open_db(f"sqlite:///{tmp_path / 'store.db'}")
    migrate(db)
    return db


@contextlib.asynccontextmanager
async def replicas(
    db: Engine, shared: SharedRedis, n: int = 2, ttl_s: float = 60
) -> AsyncIterator[list[Authenticator]]:
    """`n` replicas' key caches over one store and one Redis, listening for revocations."""
    auths = [Authenticator(db, ttl_s, shared=shared.level()) for _ in range(n)]
    for auth in auths:
        auth.start()
    await eventually(lambda: _listening(shared) == n, what=f"{n} replicas listening for revocations")
    try:
        yield auths
    finally:
        for auth in auths:
            await auth.close()
            assert auth.shared is not None
            await auth.shared.close()


async def test_a_key_one_replica_looked_up_is_found_in_l2_by_the_next(
    db: Engine, shared_redis: SharedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    info, key = create_tenant(db, "acme")
    async with replicas(db, shared_redis) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == info  # from the store, now in L2
        lookups = []
        monkeypatch.setattr("gateway.auth.find_by_key", lambda *args: lookups.append(args))
        assert await b.authenticate(f"Bearer {key}") == info and lookups == []  # L2, not the store
        with pytest.raises(Unauthenticated):  # an unknown key is never in L2: the store says so
            await b.authenticate("Bearer no-such-key-0123456789")
        assert len(lookups) == 1


def _listening(shared: SharedRedis) -> int:
    """How many replicas are subscribed to the revocations channel."""
    with redis.Redis.from_url(shared.url) as client:
        ((_, count),) = client.pubsub_numsub(shared_key(shared.prefix, REVOCATIONS))
    return int(count)


async def test_a_revocation_through_one_replica_is_refused_by_the_other_long_before_its_cache_expires(
    db: Engine, shared_redis: SharedRedis
) -> None:
    info, key = create_tenant(db, "acme")
    async with replicas(db, shared_redis) as (a, b):
        for auth in (a, b):
            assert await auth.authenticate(f"Bearer {key}") == info  # in both L1s, and in L2
        digest = revoke_tenant(db, "acme")
        assert digest is not None
        assert await asyncio.to_thread(announce_key_change, shared_redis.config, digest, revoked=True)

        async def refused(auth: Authenticator) -> bool:
            try:
                await auth.authenticate(f"Bearer {key}")
            except Unauthenticated:
                return True
            return False

        for auth in (b, a):  # L1 would hold it for 60 s: the announcement did it
            await eventually(lambda auth=auth: refused(auth), timeout_s=30, what="the revocation")
        # and no replica puts it back in L2 from a store read made before the revocation
        late = Authenticator(db, 60, shared=shared_redis.level())
        with pytest.raises(Unauthenticated):
            await late.authenticate(f"Bearer {key}")
        assert late.shared is not None
        await late.shared.close()


async def test_changed_limits_reach_the_replicas_when_announced(
    db: Engine, shared_redis: SharedRedis
) -> None:
    info, key = create_tenant(db, "acme")
    async with replicas(db, shared_redis) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == await b.authenticate(f"Bearer {key}") == info
        with db.begin() as connection:
            connection.exec_driver_sql("UPDATE tenants SET tokens_per_minute = 1000")
        assert announce_key_change(shared_redis.config, hash_key(key), revoked=False)
        expected = dataclasses.replace(info, tokens_per_minute=1000)
        for auth in (a, b):
            await eventually(  # L1 would hold the old ones for 60 s: the announcement did it
                lambda auth=auth: _authenticated(auth, key, expected), timeout_s=30, what="the new limits"
            )


async def _authenticated(auth: Authenticator, key: str, expected: TenantInfo) -> bool:
    return await auth.authenticate(f"Bearer {key}") == expected


async def test_through_an_outage_l1_and_the_store_serve_and_a_replica_back_on_redis_forgets_what_it_missed(
    db: Engine, redis_server: RedisServer
) -> None:
    info, key = create_tenant(db, "acme")
    _, other_key = create_tenant(db, "globex")
    async with replicas(db, redis_server.shared) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == info
        redis_server.stop()
        assert (await a.authenticate(f"Bearer {other_key}")).name == "globex"  # the store, L2 down
        assert (await b.authenticate(f"Bearer {key}")).name == "acme"
        # revoked while Redis is down: the announcement cannot be made, and b's L1 holds the key
        digest = revoke_tenant(db, "acme")
        assert digest is not None and not announce_key_change(
            redis_server.shared.config, digest, revoked=True
        )
        assert (await b.authenticate(f"Bearer {key}")).name == "acme"  # until its L1 TTL (60 s here)
        redis_server.start()
        await eventually(lambda: b.shared is not None and b.shared.available, timeout_s=5, what="Redis back")
        with pytest.raises(Unauthenticated):  # back on Redis, it forgot its L1: the store answers
            await b.authenticate(f"Bearer {key}")


async def test_what_redis_holds_is_a_tenant_only_under_a_gateways_signature(
    db: Engine, shared_redis: SharedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    info, key = create_tenant(db, "acme")
    async with replicas(db, shared_redis, n=1) as (a,):
        assert await a.authenticate(f"Bearer {key}") == info  # now in L2, signed

    def entry(api_key: str) -> str:
        return shared_key(shared_redis.prefix, KEY_ENTRY, hash_key(api_key))

    forged, copied = "rf_forged_key_0123456789", "rf_copied_key_0123456789"
    with redis.Redis.from_url(shared_redis.url) as client:  # what write access to Redis can do
        signed = client.get(entry(key))
        client.set(entry(forged), json.dumps(dataclasses.asdict(info)))  # a tenant, unsigned
        client.set(entry(copied), signed)  # a gateway's signed value, under another key's hash
        raised = dataclasses.replace(info, requests_per_minute=10**9)
        client.set(entry(key), json.dumps(dataclasses.asdict(raised)))  # the tenant's limits, raised
    with caplog.at_level(logging.WARNING, logger="gateway.signed_values"):
        async with replicas(db, shared_redis, n=1) as (b,):
            for api_key in (forged, copied):
                with pytest.raises(Unauthenticated):
                    await b.authenticate(f"Bearer {api_key}")
            assert await b.authenticate(f"Bearer {key}") == info  # the store's answer, not Redis's
    warnings = [r.getMessage() for r in caplog.records if "without a valid signature" in r.getMessage()]
    assert len(warnings) == 1  # logged once, however many


@pytest.fixture
def acl_user(shared_redis: SharedRedis) -> Iterator[tuple[str, str]]:
    """A user of the machine's Redis (name, password) who may touch the test's prefix only."""
    name, password = f"reflow-test-{uuid.uuid4().hex[:8]}", secrets.token_urlsafe(16)
    prefix = shared_redis.prefix
    with redis.Redis.from_url(shared_redis.url) as admin:
        admin.execute_command(
            "ACL", "SETUSER", name, "on", f">{password}", f"~{prefix}*", f"&{prefix}*", "+@all"
        )
    try:
        yield name, password
    finally:
        with redis.Redis.from_url(shared_redis.url) as admin:
            admin.execute_command("ACL", "DELUSER", name)


def as_user(shared: SharedRedis, name: str, password: str) -> SharedRedis:
    """`shared` reached as the Redis user `name`."""
    where = urlsplit(shared.url)
    return SharedRedis(
        where._replace(netloc=f"{name}:{password}@{where.hostname}:{where.port}").geturl(), shared.prefix
    )


async def test_the_shared_level_runs_as_an_acl_user_and_says_so_when_its_password_is_wrong(
    db: Engine,
    shared_redis: SharedRedis,
    acl_user: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    name, password = acl_user
    info, key = create_tenant(db, "acme")
    user = as_user(shared_redis, name, password)
    async with replicas(db, user) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == info
        lookups: list[object] = []
        monkeypatch.setattr("gateway.auth.find_by_key", lambda *args: lookups.append(args))
        assert await b.authenticate(f"Bearer {key}") == info and lookups == []  # from L2
        assert a.shared is not None
        quotas = SharedQuotas(a.shared, 15, LocalQuotas())
        async with quotas.admit(info, 10):  # its scripts and keys are the user's to run and touch
            pass
        await quotas.close()
        assert a.shared.available and b.shared is not None and b.shared.available
    monkeypatch.undo()

    wrong = as_user(shared_redis, name, "not-" + password)
    assert password not in repr(wrong.config)
    level = wrong.level()
    with caplog.at_level(logging.INFO):
        auth = Authenticator(db, 60, shared=level)
        assert await auth.authenticate(f"Bearer {key}") == info  # from the store: Redis is optional
        assert not level.available
        await level.close()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"Redis at redis://127.0.0.1:{urlsplit(shared_redis.url).port}/0 refuses the user name or "
               "password of REFLOW_REDIS_URL" in line for line in said), said  # fmt: skip
    assert not any(password in line for line in said)


@pytest.fixture
def tls_redis(tmp_path: Path, shared_redis: SharedRedis) -> Iterator[SharedRedis]:
    """A redis-server of the test's own serving TLS only, with a certificate a test CA signed; its
    URL (`rediss://`) names the CA to trust."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs redis-server (apt install redis-server)")
    files = tls_files(tmp_path / "tls", "redis test CA")
    (cert, key), (ca, _) = files["gateway"], files["ca"]
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file",
         str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no", "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    shared = SharedRedis(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", shared_redis.prefix)

    def answers() -> bool:
        if process.poll() is not None:
            pytest.skip("this redis-server serves no TLS (built without it)")
        try:
            with redis.Redis.from_url(shared.url, socket_timeout=0.5) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        wait_for(answers, 10, what=f"redis-server with TLS on port {port}")
        yield shared
    finally:
        process.kill()
        process.wait(10)


async def test_the_shared_level_runs_over_tls(
    db: Engine, tls_redis: SharedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    info, key = create_tenant(db, "acme")
    async with replicas(db, tls_redis) as (a, b):
        assert await a.authenticate(f"Bearer {key}") == info
        lookups: list[object] = []
        monkeypatch.setattr("gateway.auth.find_by_key", lambda *args: lookups.append(args))
        assert await b.authenticate(f"Bearer {key}") == info and lookups == []  # from L2, over TLS
        assert a.shared is not None and a.shared.available
    plaintext = tls_redis.url.partition("?")[0].replace("rediss://", "redis://")
    with pytest.raises(redis.RedisError), redis.Redis.from_url(plaintext, socket_timeout=1) as client:
        client.ping()  # the port speaks TLS only
