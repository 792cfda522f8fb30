"""Moving a model's aliases — promote a version, roll back the challenger — and telling the
workers at once, so they swap now rather than at their next registry poll.

Pushing is best effort: a worker that does not answer still follows the registry within
REFLOW_REGISTRY_POLL_S.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from reflow.registry import BASE_VERSION_TAG, CHAMPION, TENANT_TAG, Registry, tenant_alias
from reflow.scopes import SHARED, Scope
from reflow.v1 import worker_pb2
from reflow.worker_calls import WorkerTargets, call_workers

logger = logging.getLogger(__name__)
PUSH_TIMEOUT_S = 120.0  # a worker loads, compiles and warms the new version before it answers


def promote(
    registry: Registry,
    name: str,
    version: str,
    cache_dir: Path,
    scope: Scope = SHARED,
    unshared: Iterable[int] = (),
) -> str:
    """Makes `version` the champion of `scope` and returns the champion's version; it stops being
    the scope's challenger if it was one.

    For the shared model, each tenant in `unshared` (the ids of those that did not opt into it)
    without a champion of its own first gets one: the version it was served, so nothing the shared
    model learned from other tenants reaches it. Then the champion becomes `version` itself, or for
    a LoRA adapter its base with the adapter merged in, registered as a new version (merging.py says
    why). A tenant's own champion stays an adapter: served over the weights it was trained on, in
    the same batches as everyone else's.
    """
    champion, ref = version, registry.resolve(name, version=version)
    if (owner := registry.tags(ref).get(TENANT_TAG, "")) and owner != scope.tenant:
        raise LookupError(f"{name} v{version} is tenant {owner}'s own: it is never {scope}'s champion")
    if not scope.tenant:
        was = registry.aliases(name).get(CHAMPION)
        for tenant_id in unshared:
            pin = tenant_alias(tenant_id, CHAMPION)
            if was is not None and not registry.has_alias(name, pin):
                registry.set_alias(name, pin, was)
        if base := registry.tags(ref).get(BASE_VERSION_TAG):
            from feedback.experiments.merging import merged_version  # torch: only when there is one

            champion = merged_version(registry, ref, base, cache_dir)
    registry.set_alias(name, scope.champion, champion)
    try:
        challenger = registry.resolve(name, alias=scope.challenger).version
    except LookupError:
        return champion
    if challenger == version:
        registry.delete_alias(name, scope.challenger)
    return champion


def roll_back(registry: Registry, name: str, version: str = "", scope: Scope = SHARED) -> bool:
    """Removes the challenger of `scope` (when `version` is given, only if it still points there):
    the champion keeps all traffic. False when there was none to remove."""
    if version:
        try:
            if registry.resolve(name, alias=scope.challenger).version != version:
                return False
        except LookupError:
            return False
    return registry.delete_alias(name, scope.challenger)


def push_to_workers(targets: WorkerTargets, timeout_s: float = PUSH_TIMEOUT_S) -> dict[str, str]:
    """Asks every worker (REFLOW_WORKERS, else those of endpoints.json) to follow its aliases now;
    returns address -> "ok" or the failure, once each has loaded what it needed (or failed, or
    timed out)."""
    results = call_workers(targets, "SyncAliases", worker_pb2.SyncAliasesRequest(), timeout_s)
    for address, result in results.items():
        if isinstance(result, str):
            logger.warning(
                "worker %s did not take the push (%s); it follows at its next poll", address, result
            )
    return {address: result if isinstance(result, str) else "ok" for address, result in results.items()}
