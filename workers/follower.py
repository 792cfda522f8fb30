"""Keeps a worker's versions in step with the registry's aliases: hot-swap without dropping a request.

A worker follows the aliases it is given (REFLOW_WORKER_ALIASES: the shared champion and
challenger) and every tenant's own (reflow/scopes.py), so each tenant's versions are served
beside everyone else's.

Every `poll_s` (and whenever `sync` is called) the follower resolves each alias it follows. When
an alias points at a version the worker does not hold, that version is fetched, loaded, compiled
and warmed up off the engine thread, so running sequences keep decoding; then the alias moves to it
in one step, and the next Status tells the gateway to route there. A version that lost its last
alias keeps serving what the gateway still sends it (the gateway's view may be a poll behind) and
is unloaded once it has had no new request for `retire_idle_s`; sequences already running finish
on the weights they started with. Each version is a module of its own, compiled on its own, so a
compiled step never runs with another version's weights.
"""

from __future__ import annotations

import asyncio
import logging
import time

from reflow.registry import CHAMPION, TENANT_ALIAS
from workers.versions import Versions

logger = logging.getLogger(__name__)
RETIRE_IDLE_S = 10.0  # well beyond the gateway's status poll (REFLOW_WORKER_POLL_S, 1 s by default)


class AliasFollower:
    """Moves `aliases` of model `name` on one worker to wherever the registry points them."""

    def __init__(
        self,
        versions: Versions,
        name: str,
        aliases: list[str],
        poll_s: float,
        retire_idle_s: float = RETIRE_IDLE_S,
    ):
        self.versions = versions
        self.name = name
        self.aliases = aliases
        self.poll_s = poll_s
        self.retire_idle_s = retire_idle_s
        self._released: set[str] = set()  # versions that lost their aliases here, to unload when idle
        self._lock = asyncio.Lock()  # one sync at a time (the poll and a push may overlap)

    async def run(self) -> None:
        """Syncs every `poll_s` until cancelled; a failed round is logged and retried."""
        while True:
            try:
                await self.sync()
            except Exception:
                logger.exception(
                    "following the aliases of %s failed; retrying in %.0fs", self.name, self.poll_s
                )
            await asyncio.sleep(self.poll_s)

    def follows(self, alias: str) -> bool:
        """True for the aliases it was given and every tenant's own (reflow.registry.TENANT_ALIAS):
        a tenant's versions are served by the same workers, in the same batches."""
        return alias in self.aliases or TENANT_ALIAS.fullmatch(alias) is not None

    async def sync(self, strict: bool = False) -> None:
        """One round: load what the aliases point at, move them all at once, unload what is idle.

        The aliases are read in one call, so a promotion that pins tenants to the old champion
        before moving it is never seen half done. An alias whose version fails to load keeps
        serving where it was, and the next round tries again; while a tenant's champion cannot be
        served, the shared champion does not move either (that tenant must never be routed to a
        champion that learned from others). `strict` (a worker starting): a failed load raises."""
        registry, engine = self.versions.registry, self.versions.engine
        if registry is None:
            return
        async with self._lock:
            snapshot = await asyncio.to_thread(registry.aliases, self.name)
            targets = {alias: version for alias, version in snapshot.items() if self.follows(alias)}
            held = {a for m in engine.loaded() if m.name == self.name for a in m.aliases if self.follows(a)}
            loaded = {}
            for version in sorted(set(targets.values()), key=int):
                try:
                    loaded[version] = await self.versions.load(self.name, version=version)
                except Exception:
                    if strict:
                        raise
                    logger.exception("loading %s/%s failed; its aliases stay put", self.name, version)
            stuck = {alias for alias, version in targets.items() if version not in loaded}
            if any(TENANT_ALIAS.fullmatch(a) and a.endswith(CHAMPION) for a in stuck):
                stuck.add(CHAMPION)
            moves = []
            for alias in sorted(held | set(targets)):  # the move itself: no await from here on
                target = targets.get(alias)
                if alias in stuck:
                    continue
                holders = [m for m in engine.loaded() if m.name == self.name and alias in m.aliases]
                if [m.version for m in holders] == ([target] if target is not None else []):
                    continue  # already where the registry points
                for previous in holders:
                    previous.aliases.discard(alias)
                    if not previous.aliases:
                        self._released.add(previous.version)
                if target is not None:
                    loaded[target].aliases.add(alias)
                    self._released.discard(target)
                moves.append(f"@{alias}: {','.join(m.version for m in holders) or '-'} -> {target or '-'}")
            for move in moves:
                logger.info("%s of %s", move, self.name)
            self._retire_idle()

    def _retire_idle(self) -> None:
        """Unloads each released version idle for `retire_idle_s`; a base waits for the adapters
        served over its weights to go first, and goes next when none of its own aliases is left (a
        base an adapter brought in has none)."""
        now = time.monotonic()
        engine = self.versions.engine
        for version in sorted(self._released):
            loaded = engine.find(self.name, version)
            if loaded is None or loaded.aliases:
                self._released.discard(version)
            elif any(m.base_version == version for m in engine.loaded() if m.name == self.name):
                continue  # its adapters first
            elif now - loaded.last_request > self.retire_idle_s:
                engine.remove(self.name, version)
                self._released.discard(version)
                base = engine.find(self.name, loaded.base_version) if loaded.base_version else None
                if base is not None and not base.aliases:
                    self._released.add(base.version)
                logger.info(
                    "unloaded %s/%s: no alias and no request for %.0fs",
                    self.name,
                    version,
                    now - loaded.last_request,
                )
