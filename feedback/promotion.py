"""Moving a model's aliases — promote a version, roll back the challenger — and telling the
workers at once, so they swap now rather than at their next registry poll.

Pushing is best effort: a worker that does not answer still follows the registry within
REFLOW_REGISTRY_POLL_S.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from feedback.experiments import CHALLENGER, CHAMPION
from feedback.registry import Registry
from reflow.mtls import worker_channel
from reflow.settings import Settings
from reflow.v1 import worker_pb2, worker_pb2_grpc
from workers.isolation import join_gateway_group

logger = logging.getLogger(__name__)
PUSH_TIMEOUT_S = 120.0  # a worker loads, compiles and warms the new version before it answers


def promote(registry: Registry, name: str, version: str) -> None:
    """Makes `version` the champion; it stops being the challenger if it was one."""
    registry.set_alias(name, CHAMPION, version)
    try:
        challenger = registry.resolve(name, alias=CHALLENGER).version
    except LookupError:
        return
    if challenger == version:
        registry.delete_alias(name, CHALLENGER)


def roll_back(registry: Registry, name: str, version: str = "") -> bool:
    """Removes the challenger (when `version` is given, only if it still points there): the
    champion keeps all traffic. False when there was none to remove."""
    if version:
        try:
            if registry.resolve(name, alias=CHALLENGER).version != version:
                return False
        except LookupError:
            return False
    return registry.delete_alias(name, CHALLENGER)


def worker_addresses(settings: Settings) -> list[str]:
    """The workers to tell: REFLOW_WORKERS, else those `reflow up` lists in endpoints.json."""
    if settings.workers:
        return settings.workers
    endpoints = settings.data_dir / "endpoints.json"
    try:
        return list(json.loads(endpoints.read_text())["workers"])
    except (OSError, ValueError, KeyError):
        return []


def push_to_workers(
    addresses: list[str], settings: Settings, timeout_s: float = PUSH_TIMEOUT_S
) -> dict[str, str]:
    """Asks every worker, in parallel, to follow its aliases now; returns address -> "ok" or the
    failure. Returns once each has loaded what it needed (or failed, or timed out). `settings`
    give the mTLS files, when the workers use them."""
    if not addresses:
        return {}
    join_gateway_group(settings, create=False)  # isolated workers admit only the gateway's group
    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        return dict(zip(addresses, pool.map(lambda a: _push(a, settings, timeout_s), addresses), strict=True))


def _push(address: str, settings: Settings, timeout_s: float) -> str:
    with worker_channel(address, settings) as channel:
        try:
            worker_pb2_grpc.WorkerStub(channel).SyncAliases(
                worker_pb2.SyncAliasesRequest(), timeout=timeout_s
            )
        except grpc.RpcError as error:
            failure = f"{error.code().name}: {error.details()}"
            logger.warning(
                "worker %s did not take the push (%s); it follows at its next poll", address, failure
            )
            return failure
    return "ok"
