"""The gateway's view of running experiments: which version a tenant is served, which arm a
request gets, and where that arm runs.

A request that names its model without an alias or version is served its tenant's champion: the
tenant's own (reflow/scopes.py: trained on its feedback alone, or the version it was pinned
to when the shared model learned from others) once a worker serves it, else the shared champion.
It takes part in the experiment of its tenant's scope (its own for a tenant training its own
versions, the shared model's for a tenant in it, none for one whose feedback trains nothing), and
only once a worker serves the challenger: until then everyone gets the champion and nothing is
counted, so the split is never skewed by a challenger still loading.

The arm is drawn from a keyed hash of the experiment, the tenant and the user (else the request)
under a server secret: a client can neither pick its arm nor share one with another tenant's user
of the same name. The view is re-read from the store at most every `poll_s`, in the background of
the request that finds it stale, so no request waits on the store.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass

from sqlalchemy import Engine

from gateway.routing import ModelSpec, WorkerPool
from gateway.tenants import TenantInfo
from reflow.registry import CHALLENGER, CHAMPION, tenant_alias
from reflow.store.experiments import RunningExperiment, running_experiments
from reflow.store.tables import TRAINS_OWN, TRAINS_SHARED

ASSIGNMENT_KEY = "assignment_key"  # the store's secret (reflow/store/secrets.py) arms are drawn with

logger = logging.getLogger(__name__)


def assigned_arm(key: bytes, experiment_id: int, tenant: str, unit: str, traffic: float) -> str:
    """The arm of assignment unit `unit` (a user id, else a request id) of `tenant`: the same unit
    always gets the same arm within an experiment, and about `traffic` of all units get the
    challenger."""
    digest = hmac.digest(key, f"{experiment_id}\0{tenant}\0{unit}".encode(), "sha256")
    return CHALLENGER if int.from_bytes(digest[:8], "big") < traffic * 2**64 else CHAMPION


@dataclass
class Assignment:
    """Where one request goes: the spec to route, its arm, the experiment that chose it, and the
    spec of its tenant's champion (where it goes when its challenger is gone, in its arm still)."""

    spec: ModelSpec
    arm: str
    experiment: RunningExperiment | None = None
    champion: ModelSpec | None = None

    def fall_back_to_champion(self) -> bool:
        """Routes a request of an experiment's challenger arm to the champion, once, where the
        challenger went away under it (rolled back, or no worker serving it could take it); False
        for any other request, or one routed there already.

        It stays in the challenger's arm, where it was assigned (analysed as assigned, whoever
        answers): dropping it would take units from that arm alone, whose split the sample ratio
        check would then find skewed, and hide the challenger's failures from its guardrail."""
        champion = self.champion or ModelSpec(self.spec.name, alias=CHAMPION)
        if self.experiment is None or self.arm != CHALLENGER or self.spec == champion:
            return False
        self.spec = champion
        return True


class ExperimentView:
    """Running experiments by model, refreshed from the store without blocking requests."""

    def __init__(self, db: Engine, poll_s: float, key: bytes) -> None:
        self.db = db
        self.poll_s = poll_s
        self.key = key  # ASSIGNMENT_KEY, shared by every replica: a unit gets one arm everywhere
        self.running: dict[tuple[str, str], RunningExperiment] = {}  # by (model, tenant or "")
        self._loaded_at = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Re-reads the running experiments; on a store error the last view stays."""
        try:
            found = await asyncio.to_thread(running_experiments, self.db)
        except Exception:
            logger.exception("could not read running experiments; keeping the last view")
            return
        finally:
            self._loaded_at = time.monotonic()
        self.running = {(e.model, e.tenant): e for e in found}

    def _refresh_if_stale(self) -> None:
        stale = time.monotonic() - self._loaded_at > self.poll_s
        if stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self.refresh(), name="experiments-refresh")

    def assign(
        self, requested: str, spec: ModelSpec, tenant: TenantInfo, unit: str, pool: WorkerPool
    ) -> Assignment:
        """The assignment of `tenant`'s request for `requested` (the model field as sent) whose
        sticky unit is `unit` (its user id, else its request id)."""
        self._refresh_if_stale()
        explicit = "@" in requested or "/" in requested
        if explicit or spec.alias != CHAMPION:
            return Assignment(spec, spec.alias)
        champion = spec
        scope: str | None = ""  # whose experiment it takes part in: "" the shared model's; None none
        if tenant.trains != TRAINS_SHARED:
            own = ModelSpec(spec.name, alias=tenant_alias(tenant.id, CHAMPION))
            champion = own if pool.serves(own) else spec
            scope = tenant.name if tenant.trains == TRAINS_OWN else None
        experiment = self.running.get((spec.name, scope)) if scope is not None else None
        if experiment is None:
            return Assignment(champion, CHAMPION, champion=champion)
        arm_alias = tenant_alias(tenant.id, CHALLENGER) if scope else CHALLENGER
        if not pool.serves(ModelSpec(spec.name, alias=arm_alias), version=experiment.challenger_version):
            return Assignment(champion, CHAMPION, champion=champion)  # not loaded yet, or rolled back
        if assigned_arm(self.key, experiment.id, tenant.name, unit, experiment.traffic) == CHALLENGER:
            challenger = ModelSpec(spec.name, version=experiment.challenger_version)
            return Assignment(challenger, CHALLENGER, experiment, champion)
        return Assignment(champion, CHAMPION, experiment, champion)
