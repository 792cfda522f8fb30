"""Tenants and API keys: create, revoke and look up keys, which are stored only as SHA-256 hashes."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from reflow.api_keys import MIN_API_KEY_LENGTH, display_prefix, hash_key, new_key
from reflow.store.tables import DEFAULT_MAX_STREAMS, TRAINS, TRAINS_OWN, TRAINS_SHARED, Tenant, utcnow


@dataclass(frozen=True)
class Limits:
    """A tenant's quotas (gateway/quotas.py); 0 = no limit. The defaults are a new tenant's."""

    max_concurrent_streams: int = DEFAULT_MAX_STREAMS
    requests_per_minute: int = 600
    tokens_per_minute: int = 0  # prompt + completion tokens, the unit LLM use is billed in


UNLIMITED = Limits(0, 0, 0)  # a benchmark's tenant, bounded only by the workers' queues


@dataclass(frozen=True)
class TenantInfo:
    """What the gateway needs to know about the caller of a request."""

    id: int
    name: str
    max_concurrent_streams: int
    requests_per_minute: int
    tokens_per_minute: int = 0
    trains: str = TRAINS_SHARED  # what its feedback trains (reflow/store/tables.py's TRAINS)


def _info(tenant: Tenant) -> TenantInfo:
    return TenantInfo(
        tenant.id, tenant.name, tenant.max_concurrent_streams, tenant.requests_per_minute,
        tenant.tokens_per_minute, tenant.trains,
    )  # fmt: skip


def _check_trains(trains: str) -> None:
    if trains not in TRAINS:
        raise ValueError(f"a tenant's feedback trains one of {', '.join(TRAINS)}, not {trains!r}")


def _set_limits(tenant: Tenant, limits: Limits) -> None:
    tenant.max_concurrent_streams = limits.max_concurrent_streams
    tenant.requests_per_minute = limits.requests_per_minute
    tenant.tokens_per_minute = limits.tokens_per_minute


def create_tenant(
    db: Engine,
    name: str,
    *,
    api_key: str | None = None,
    limits: Limits = Limits(),
    trains: str = TRAINS_OWN,
) -> tuple[TenantInfo, str]:
    """Creates a tenant with `api_key` (or a new one); returns it and the key, shown only now.

    A new tenant's feedback trains its own versions unless it says otherwise: the shared model is
    served to every tenant in it, so joining it is a choice each of them makes."""
    key = api_key or new_key()
    if len(key) < MIN_API_KEY_LENGTH:
        raise ValueError(f"an API key needs at least {MIN_API_KEY_LENGTH} characters")
    if not name.strip():
        raise ValueError("a tenant needs a name")  # "" is the shared model's scope, nobody's name
    _check_trains(trains)
    with Session(db) as session, session.begin():
        if session.scalar(select(Tenant).where(Tenant.name == name)) is not None:
            raise ValueError(f"tenant {name!r} already exists")
        tenant = Tenant(name=name, key_hash=hash_key(key), key_prefix=display_prefix(key), trains=trains)
        _set_limits(tenant, limits)
        session.add(tenant)
        session.flush()
        return _info(tenant), key


def ensure_tenant(
    db: Engine, name: str, api_key: str, limits: Limits = Limits()
) -> tuple[TenantInfo, str | None]:
    """The tenant `name` holding `api_key` with `limits`: created (training the shared model: one
    team serving its own users learns with no setting turned), re-keyed to a new key or given the
    limits, as needed; also the hash of the key it held before, when that one is retired. What an
    existing tenant trains is left as `reflow tenants update` set it.

    A revoked key is never brought back: re-keying with a different key re-enables the
    tenant, the same key raises ValueError.
    """
    with Session(db) as session, session.begin():
        tenant = session.scalar(select(Tenant).where(Tenant.name == name))
        if tenant is not None:
            retired = None
            if tenant.key_hash == hash_key(api_key):
                if tenant.revoked_at is not None:
                    raise ValueError(
                        f"the API key of tenant {name!r} was revoked; set a new REFLOW_API_KEY "
                        "or delete the api_key file in the data dir to generate one"
                    )
            else:
                if len(api_key) < MIN_API_KEY_LENGTH:
                    raise ValueError(f"an API key needs at least {MIN_API_KEY_LENGTH} characters")
                retired = tenant.key_hash
                tenant.key_hash, tenant.key_prefix, tenant.revoked_at = (
                    hash_key(api_key),
                    display_prefix(api_key),
                    None,
                )
            _set_limits(tenant, limits)
            return _info(tenant), retired
    return create_tenant(db, name, api_key=api_key, limits=limits, trains=TRAINS_SHARED)[0], None


def update_tenant(
    db: Engine, name: str, *, limits: Limits | None = None, trains: str | None = None
) -> tuple[TenantInfo, str]:
    """Changes a tenant's quotas and what its feedback trains (None: unchanged); returns it and the
    hash of its key (what gateways are told changed); LookupError when there is no such tenant.
    A fine-tune run uses what the store says when it starts."""
    if trains is not None:
        _check_trains(trains)
    with Session(db) as session, session.begin():
        tenant = session.scalar(select(Tenant).where(Tenant.name == name))
        if tenant is None:
            raise LookupError(f"there is no tenant named {name!r}")
        if limits is not None:
            _set_limits(tenant, limits)
        if trains is not None:
            tenant.trains = trains
        return _info(tenant), tenant.key_hash


def find_tenant(db: Engine, name: str) -> tuple[TenantInfo, str, bool]:
    """The tenant `name` with its key prefix and whether it is revoked; LookupError when none."""
    with Session(db) as session:
        tenant = session.scalar(select(Tenant).where(Tenant.name == name))
        if tenant is None:
            raise LookupError(f"there is no tenant named {name!r}")
        return _info(tenant), tenant.key_prefix, tenant.revoked_at is not None


def revoke_tenant(db: Engine, name: str) -> str | None:
    """Disables a tenant's key; returns its hash (what gateways must forget), or None when there is
    no such active tenant."""
    with Session(db) as session, session.begin():
        tenant = session.scalar(select(Tenant).where(Tenant.name == name, Tenant.revoked_at.is_(None)))
        if tenant is None:
            return None
        tenant.revoked_at = utcnow()
        return tenant.key_hash


def list_tenants(db: Engine) -> list[tuple[TenantInfo, str, bool]]:
    """Every tenant with its key prefix and whether it is revoked."""
    with Session(db) as session:
        tenants = session.scalars(select(Tenant).order_by(Tenant.id)).all()
        return [(_info(t), t.key_prefix, t.revoked_at is not None) for t in tenants]


def find_by_key(db: Engine, api_key: str) -> TenantInfo | None:
    """The active tenant holding `api_key`, or None."""
    with Session(db) as session:
        tenant = session.scalar(
            select(Tenant).where(Tenant.key_hash == hash_key(api_key), Tenant.revoked_at.is_(None))
        )
        return None if tenant is None else _info(tenant)
