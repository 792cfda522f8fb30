"""Learning scopes: whose feedback trains a line of versions, and the aliases those versions go by.

The shared model (`champion`, `challenger`) learns from the feedback of every tenant that opted
into it (`tenants.trains = shared`) and is tested on their traffic alone. A tenant that trains its
own (`own`) has a scope of its own: its feedback alone trains its versions (LoRA adapters over the
weights it is served, on Llama-family models), registered under its own aliases, A/B tested on its
own traffic and promoted for it alone. A tenant whose feedback trains nothing is in no scope.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from reflow.registry import CHALLENGER, CHAMPION, Registry, VersionRef, tenant_alias
from reflow.store.tables import TRAINS_OWN, TRAINS_SHARED, Tenant


@dataclass(frozen=True)
class Scope:
    """The shared model (no tenant), or one tenant's own versions."""

    tenant: str = ""  # the tenant's name, as inferences and feedback carry it; "" = the shared model
    tenant_id: int = 0

    @property
    def champion(self) -> str:
        """The alias of the scope's champion (a tenant without one of its own is served the shared
        champion)."""
        return tenant_alias(self.tenant_id, CHAMPION) if self.tenant else CHAMPION

    @property
    def challenger(self) -> str:
        return tenant_alias(self.tenant_id, CHALLENGER) if self.tenant else CHALLENGER

    def __str__(self) -> str:
        return f"tenant {self.tenant}" if self.tenant else "the shared model"


SHARED = Scope()


def champion_of(registry: Registry, model: str, scope: Scope) -> VersionRef:
    """The version `scope` serves as its champion: its own, else the shared champion; LookupError
    when `model` has neither."""
    if scope.tenant:
        try:
            return registry.resolve(model, alias=scope.champion)
        except LookupError:
            pass
    return registry.resolve(model, alias=CHAMPION)


def learning_scopes(db: Engine) -> list[Scope]:
    """The shared model, then each active tenant that trains its own versions."""
    with Session(db) as session:
        own = session.execute(
            select(Tenant.name, Tenant.id)
            .where(Tenant.trains == TRAINS_OWN, Tenant.revoked_at.is_(None))
            .order_by(Tenant.id)
        ).all()
    return [SHARED, *(Scope(name, tenant_id) for name, tenant_id in own)]


def scope_of(db: Engine, tenant: str) -> Scope:
    """The scope of tenant `tenant` ("" = the shared model's); LookupError when there is no such
    tenant or it trains no versions of its own."""
    if not tenant:
        return SHARED
    with Session(db) as session:
        found = session.execute(select(Tenant.id, Tenant.trains).where(Tenant.name == tenant)).first()
    if found is None:
        raise LookupError(f"there is no tenant named {tenant!r}")
    if found.trains != TRAINS_OWN:
        raise LookupError(
            f"tenant {tenant!r} trains {found.trains!r}, not its own versions; "
            f"`reflow tenants update {tenant} --trains own` gives it some"
        )
    return Scope(tenant, found.id)


def scope_named(db: Engine, tenant: str) -> Scope:
    """The scope of tenant `tenant`'s own versions, whatever it trains now (an experiment it
    opened still ends by the rules), or the shared model's for ""; LookupError for no such tenant."""
    if not tenant:
        return SHARED
    with Session(db) as session:
        tenant_id = session.scalar(select(Tenant.id).where(Tenant.name == tenant))
    if tenant_id is None:
        raise LookupError(f"there is no tenant named {tenant!r}")
    return Scope(tenant, tenant_id)


def follow_trains(registry: Registry, model: str, tenant_id: int, trains: str) -> str:
    """Moves tenant `tenant_id`'s aliases of `model` to what its feedback now trains, and says what
    it did. In the shared model: none of its own (it is served the shared champion). Outside it,
    training its own or nothing: a champion of its own at once, the shared champion of now when it
    has none (pinned: what the shared model learns later never reaches it, and the gateway never
    has to route it to a shared champion it must not see); training nothing: no challenger."""
    aliases = registry.aliases(model)
    champion, challenger = tenant_alias(tenant_id, CHAMPION), tenant_alias(tenant_id, CHALLENGER)
    dropped = [
        a
        for a in (champion, challenger)
        if a in aliases and (trains == TRAINS_SHARED or (a == challenger and trains != TRAINS_OWN))
    ]
    for alias in dropped:
        registry.delete_alias(model, alias)
    if trains != TRAINS_SHARED and champion not in aliases and CHAMPION in aliases:
        registry.set_alias(model, champion, aliases[CHAMPION])
        return f"pinned to {model} v{aliases[CHAMPION]}, the shared champion of now"
    if dropped:
        return f"{', '.join('@' + a for a in dropped)} of {model} removed"
    return "aliases unchanged"


def unshared_tenant_ids(db: Engine) -> list[int]:
    """The tenants that did not opt into the shared model, revoked ones too (a key can be renewed):
    what it learns is never served to them."""
    with Session(db) as session:
        return list(session.scalars(select(Tenant.id).where(Tenant.trains != TRAINS_SHARED)).all())
