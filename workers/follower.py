"""Keeps a worker's versions in step with the registry's aliases: hot-swap without dropping a request.

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

    async def sync(self) -> None:
        """One round: load and move every alias that points elsewhere, unload what is idle."""
        registry, engine = self.versions.registry, self.versions.engine
        if registry is None:
            return
        async with self._lock:
            for alias in self.aliases:
                try:
                    target = (await asyncio.to_thread(registry.resolve, self.name, alias=alias)).version
                except LookupError:
                    target = None  # the alias was removed (a challenger rolled back)
                holders = [m for m in engine.loaded() if m.name == self.name and alias in m.aliases]
                if [m.version for m in holders] == ([target] if target is not None else []):
                    continue  # already where the registry points (or absent on both sides)
                loaded = await self.versions.load(self.name, version=target) if target is not None else None
                for previous in holders:  # the move itself: no await between these lines
                    previous.aliases.discard(alias)
                    if not previous.aliases:
                        self._released.add(previous.version)
                if loaded is not None:
                    loaded.aliases.add(alias)
                    self._released.discard(loaded.version)
                logger.info(
                    "@%s of %s: %s -> %s", alias, self.name,
                    ",".join(m.version for m in holders) or "-", target or "-",
                )  # fmt: skip
            self._retire_idle()

    def _retire_idle(self) -> None:
        now = time.monotonic()
        for version in sorted(self._released):
            loaded = self.versions.engine.find(self.name, version)
            if loaded is None or loaded.aliases:
                self._released.discard(version)
            elif now - loaded.last_request > self.retire_idle_s:
                self.versions.engine.remove(self.name, version)
                self._released.discard(version)
                logger.info(
                    "unloaded %s/%s: no alias and no request for %.0fs",
                    self.name,
                    version,
                    now - loaded.last_request,
                )
