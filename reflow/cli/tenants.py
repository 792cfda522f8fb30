"""`reflow tenants`: tenants and their API keys."""

from __future__ import annotations

from typing import Annotated

import typer

from reflow.cli.common import err_console, fail, load_settings, store_engine

app = typer.Typer(help="Manage tenants and their API keys.", no_args_is_help=True)


@app.command("create")
def tenants_create(
    name: str,
    max_streams: Annotated[int, typer.Option(min=0, help="Concurrent streams; 0 = unlimited.")] = 32,
    rpm: Annotated[int, typer.Option(min=0, help="Requests per minute; 0 = unlimited.")] = 600,
    tpm: Annotated[
        int, typer.Option(min=0, help="Tokens (prompt + completion) per minute; 0 = unlimited.")
    ] = 0,
) -> None:
    """Create a tenant and print its new API key (shown only once; stored hashed). Its limits hold
    across gateways sharing REFLOW_REDIS_URL, per gateway otherwise."""
    from gateway.tenants import Limits, create_tenant
    from reflow.store.database import migrate

    engine = store_engine()
    migrate(engine)
    try:
        _, key = create_tenant(engine, name, limits=Limits(max_streams, rpm, tpm))
    except ValueError as error:
        fail(f"{error}")
    print(key)


@app.command("revoke")
def tenants_revoke(name: str) -> None:
    """Disable a tenant's key: at once on every gateway sharing REFLOW_REDIS_URL (set it here too),
    else within REFLOW_AUTH_CACHE_TTL_S."""
    from gateway.auth import announce_key_change
    from gateway.server import redis_config
    from gateway.tenants import revoke_tenant

    digest = revoke_tenant(store_engine(), name)
    if digest is None:
        fail(f"no active tenant named {name!r}")
    if not announce_key_change(redis_config(load_settings()), digest, revoked=True):
        err_console.print(
            "revoked; no Redis announced it, so gateways notice within REFLOW_AUTH_CACHE_TTL_S "
            "(REFLOW_REDIS_KEY_TTL_S where they share a Redis: set REFLOW_REDIS_URL here to announce "
            "revocations at once)",
            soft_wrap=True,
        )


@app.command("list")
def tenants_list() -> None:
    """List tenants with their key prefix, quotas and state."""
    from gateway.tenants import list_tenants

    for info, prefix, revoked in list_tenants(store_engine()):
        state = "revoked" if revoked else "active"
        quotas = (
            f"{info.max_concurrent_streams} streams\t{info.requests_per_minute} rpm\t"
            f"{info.tokens_per_minute} tpm"
        )
        print(f"{info.name}\t{prefix}…\t{quotas}\t{state}")
