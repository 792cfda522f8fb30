"""`reflow tenants`: tenants and their API keys."""

from __future__ import annotations

from typing import Annotated

import typer

from reflow.cli.common import fail, store_engine

app = typer.Typer(help="Manage tenants and their API keys.", no_args_is_help=True)


@app.command("create")
def tenants_create(
    name: str,
    max_streams: Annotated[int, typer.Option(help="Concurrent streams per gateway.")] = 32,
    rpm: Annotated[int, typer.Option(help="Requests per minute per gateway; 0 = unlimited.")] = 600,
) -> None:
    """Create a tenant and print its new API key (shown only once; stored hashed)."""
    from gateway.tenants import create_tenant
    from reflow.store.database import migrate

    engine = store_engine()
    migrate(engine)
    try:
        _, key = create_tenant(engine, name, max_concurrent_streams=max_streams, requests_per_minute=rpm)
    except ValueError as error:
        fail(f"{error}")
    print(key)


@app.command("revoke")
def tenants_revoke(name: str) -> None:
    """Disable a tenant's key (gateways notice within REFLOW_AUTH_CACHE_TTL_S)."""
    from gateway.tenants import revoke_tenant

    if not revoke_tenant(store_engine(), name):
        fail(f"no active tenant named {name!r}")


@app.command("list")
def tenants_list() -> None:
    """List tenants with their key prefix, quotas and state."""
    from gateway.tenants import list_tenants

    for info, prefix, revoked in list_tenants(store_engine()):
        state = "revoked" if revoked else "active"
        quotas = f"{info.max_concurrent_streams} streams\t{info.requests_per_minute} rpm"
        print(f"{info.name}\t{prefix}…\t{quotas}\t{state}")
