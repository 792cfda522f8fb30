"""`reflow tenants`: tenants and their API keys."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from enum import StrEnum
from typing import Annotated

import typer

from gateway.tenants import (
    Limits,
    TenantInfo,
    create_tenant,
    find_tenant,
    list_tenants,
    revoke_tenant,
    update_tenant,
)
from reflow.cli.common import err_console, fail, load_settings, open_registry, store_db
from reflow.registry import CHALLENGER, TENANT_TAG, tenant_alias
from reflow.scopes import SHARED, Scope, champion_of, follow_trains
from reflow.store.experiments import running_experiment

app = typer.Typer(
    help="Manage tenants, their API keys, and what their feedback trains.", no_args_is_help=True
)
TRAINS_HELP = (
    "What its feedback trains: `own` (its own versions, served and A/B tested on its traffic alone), "
    "`shared` (the model every tenant in it is served, with theirs), or `nothing`."
)


class Trains(StrEnum):
    """`--trains` (reflow/store/tables.py's TRAINS)."""

    nothing = "nothing"
    shared = "shared"
    own = "own"


@app.command("create")
def tenants_create(
    name: str,
    max_streams: Annotated[int, typer.Option(min=0, help="Concurrent streams; 0 = unlimited.")] = 32,
    rpm: Annotated[int, typer.Option(min=0, help="Requests per minute; 0 = unlimited.")] = 600,
    tpm: Annotated[
        int, typer.Option(min=0, help="Tokens (prompt + completion) per minute; 0 = unlimited.")
    ] = 0,
    trains: Annotated[Trains, typer.Option(help=TRAINS_HELP)] = Trains.own,
) -> None:
    """Create a tenant and print its new API key (shown only once; stored hashed). Its limits hold
    across gateways sharing REFLOW_REDIS_URL, per gateway otherwise. Its feedback trains its own
    versions unless --trains says otherwise: joining the shared model is each tenant's choice. A
    tenant outside it is pinned at once to the shared champion of now."""
    from reflow.store.database import migrate  # alembic: 120 ms off `reflow --help`

    db = store_db()
    migrate(db)
    try:
        info, key = create_tenant(db, name, limits=Limits(max_streams, rpm, tpm), trains=trains.value)
    except ValueError as error:
        fail(f"{error}")
    print(key)
    if info.trains != Trains.shared:
        _follow_trains(info)


@app.command("update")
def tenants_update(
    name: str,
    trains: Annotated[Trains | None, typer.Option(help=TRAINS_HELP)] = None,
    max_streams: Annotated[int | None, typer.Option(min=0, help="Concurrent streams; 0 = unlimited.")] = None,
    rpm: Annotated[int | None, typer.Option(min=0, help="Requests per minute; 0 = unlimited.")] = None,
    tpm: Annotated[int | None, typer.Option(min=0, help="Tokens per minute; 0 = unlimited.")] = None,
) -> None:
    """Change what a tenant's feedback trains, or its quotas (those given; the rest stay). Gateways
    apply it at once where they share REFLOW_REDIS_URL (set it here too), else within
    REFLOW_AUTH_CACHE_TTL_S; fine-tune runs from their next start. A tenant that leaves the shared
    model is pinned at once to the shared champion of now (what the shared model learns from others
    later is never served to it); one that joins it loses its own aliases."""
    db = store_db()
    try:
        info, _, _ = find_tenant(db, name)
        given = {"max_concurrent_streams": max_streams, "requests_per_minute": rpm, "tokens_per_minute": tpm}
        now = Limits(info.max_concurrent_streams, info.requests_per_minute, info.tokens_per_minute)
        limits = replace(now, **{k: v for k, v in given.items() if v is not None})
        updated, digest = update_tenant(db, name, limits=limits, trains=trains.value if trains else None)
    except LookupError as error:
        fail(f"{error}")
    print(f"{updated.name}\ttrains {updated.trains}\t{_quotas(updated)}")
    if trains is not None:
        _follow_trains(updated)
    _announce(digest, revoked=False)


def _follow_trains(info: TenantInfo) -> None:
    """Moves the tenant's aliases of REFLOW_MODEL_NAME to what it trains (reflow/scopes.py), or says
    why it could not: the registry's next shared promotion pins it then."""
    settings = load_settings()
    try:
        done = follow_trains(open_registry(settings), settings.model_name, info.id, info.trains)
    except Exception as error:  # the tenant is stored all the same
        err_console.print(
            f"[yellow]{settings.model_name}'s aliases not moved ({type(error).__name__}: {error}); the next "
            "promotion of the shared model pins this tenant[/]", soft_wrap=True,
        )  # fmt: skip
        return
    err_console.print(f"{info.name}: {done}", highlight=False, soft_wrap=True)


@app.command("show")
def tenants_show(
    name: str,
    model: Annotated[str | None, typer.Option(help="Registered model [default: REFLOW_MODEL_NAME].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """One tenant: its key prefix, quotas and state, what its feedback trains, the version a request
    naming only the model is served (its own champion, or the shared one), and its running
    experiment."""
    settings = load_settings()
    db = store_db()
    try:
        info, prefix, revoked = find_tenant(db, name)
    except LookupError as error:
        fail(f"{error}")
    model = model or settings.model_name
    registry = open_registry(settings)
    own = Scope(info.name, info.id)
    aliases = registry.aliases(model)
    served, whose = "", "none"
    with contextlib.suppress(LookupError):
        ref = champion_of(registry, model, own if info.trains != "shared" else SHARED)
        served, whose = ref.version, "the shared model's"
        if own.champion in ref.aliases:  # trained on its feedback, or a version it was pinned to
            whose = "its own" if registry.tags(ref).get(TENANT_TAG) == info.name else "pinned"
    experiment = running_experiment(db, model, info.name if info.trains == "own" else "")
    if info.trains == "nothing":
        experiment = None
    row = {
        "name": info.name, "key_prefix": prefix, "state": "revoked" if revoked else "active",
        "trains": info.trains, "max_concurrent_streams": info.max_concurrent_streams,
        "requests_per_minute": info.requests_per_minute, "tokens_per_minute": info.tokens_per_minute,
        "model": model, "served_version": served or None, "served_champion": whose,
        "own_challenger": aliases.get(tenant_alias(info.id, CHALLENGER)),
        "experiment": experiment.id if experiment else None,
    }  # fmt: skip
    if as_json:
        print(json.dumps(row))
        return
    for key, value in row.items():
        print(f"{key}\t{value if value is not None else '-'}")


@app.command("revoke")
def tenants_revoke(name: str) -> None:
    """Disable a tenant's key: at once on every gateway sharing REFLOW_REDIS_URL (set it here too),
    else within REFLOW_AUTH_CACHE_TTL_S."""
    digest = revoke_tenant(store_db(), name)
    if digest is None:
        fail(f"no active tenant named {name!r}")
    _announce(digest, revoked=True)


def _announce(digest: str, *, revoked: bool) -> None:
    """Tells gateways sharing REFLOW_REDIS_URL that the key hashed `digest` changed or was revoked,
    or says when they will notice without it."""
    from gateway.auth import announce_key_change  # redis: 140 ms off `reflow --help`
    from gateway.server import redis_config  # FastAPI, kafka-python: 750 ms off `reflow --help`

    if not announce_key_change(redis_config(load_settings()), digest, revoked=revoked):
        err_console.print(
            f"{'revoked' if revoked else 'changed'}; no Redis announced it, so gateways notice within "
            "REFLOW_AUTH_CACHE_TTL_S (REFLOW_REDIS_KEY_TTL_S where they share a Redis: set "
            "REFLOW_REDIS_URL here to announce changes at once)",
            soft_wrap=True,
        )


@app.command("list")
def tenants_list() -> None:
    """List tenants with their key prefix, quotas, what their feedback trains, and state."""
    for info, prefix, revoked in list_tenants(store_db()):
        state = "revoked" if revoked else "active"
        print(f"{info.name}\t{prefix}…\t{_quotas(info)}\ttrains {info.trains}\t{state}")


def _quotas(info: TenantInfo) -> str:
    return (
        f"{info.max_concurrent_streams} streams\t{info.requests_per_minute} rpm\t{info.tokens_per_minute} tpm"
    )
