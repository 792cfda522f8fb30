"""The versions a worker holds: resolved in the registry, fetched, loaded and added to the engine,
off the event loop, so running sequences keep decoding while a new version arrives."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from reflow.errors import NotFound
from reflow.registry import Registry
from workers.engine import Engine
from workers.loading import LoadedModel, load_version

logger = logging.getLogger(__name__)


class Versions:
    """Loads registered versions into one engine."""

    def __init__(self, engine: Engine, registry: Registry | None, cache_dir: Path, device: torch.device):
        self.engine = engine
        self.registry = registry  # None: nothing can be loaded (a worker given its versions)
        self.cache_dir = cache_dir
        self.device = device

    async def load(self, name: str, *, version: str = "", alias: str = "") -> LoadedModel:
        """Resolves, fetches and loads a version off the event loop, then makes it servable."""
        if self.registry is None:
            raise NotFound("this worker has no registry to load from")
        registry = self.registry
        try:
            ref = await asyncio.to_thread(registry.resolve, name, version=version, alias=alias)
        except LookupError as error:
            raise NotFound(str(error)) from error
        if (present := self.engine.find(name, ref.version)) is not None:
            present.aliases |= {alias} if alias else set()
            return present
        # Fetch and build on a side thread: running sequences keep decoding meanwhile.
        try:
            loaded = await asyncio.to_thread(load_version, registry, ref, self.cache_dir, self.device, alias)
        except LookupError as error:  # the version has no files in the registry
            raise NotFound(str(error)) from error
        await asyncio.to_thread(self.engine.add, loaded)  # compiles and warms up first when enabled
        logger.info("loaded model=%s version=%s alias=%s device=%s", name, ref.version, alias, self.device)
        return loaded
