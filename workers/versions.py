"""The versions a worker holds: resolved in the registry, fetched off the event loop while running
sequences keep decoding, then built on the engine's thread and added to it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from reflow.errors import NotFound
from reflow.registry import BASE_VERSION_TAG, TENANT_TAG, Registry
from workers.dtype_choice import AutoDtype
from workers.engine import Engine
from workers.loading import load_adapter, load_directory
from workers.quality import measure_copies
from workers.residency import Copy, Resident, ResidentVersion
from workers.variants import make_variant, task_scores, wanted_variants

logger = logging.getLogger(__name__)


class Versions:
    """Loads registered versions into one engine."""

    def __init__(
        self,
        engine: Engine,
        registry: Registry | None,
        cache_dir: Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        variants: tuple[str, ...] = (),
    ):
        self.engine = engine
        self.registry = registry  # None: nothing can be loaded (a worker given its versions)
        self.cache_dir = cache_dir
        self.device = device
        self.dtype = dtype  # None: REFLOW_DTYPE=auto, measured per model shape where it can be
        self.auto_dtype = AutoDtype(engine.config.max_batch_size)
        self.variants = variants  # REFLOW_VARIANTS: built beside each version with weights of its own

    async def load(self, name: str, *, version: str = "", alias: str = "") -> Resident:
        """Resolves, fetches and loads a version off the event loop, then makes it servable; an
        adapter version is served over its base version's weights, loaded first when missing."""
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
        # Fetch on a side thread (sequences keep decoding meanwhile), then build on the engine's,
        # between two steps: all of a worker's torch work runs on one thread (workers/engine.py).
        try:
            directory = await asyncio.to_thread(registry.download, ref, self.cache_dir)
        except LookupError as error:  # the version has no files in the registry
            raise NotFound(str(error)) from error
        aliases = {alias} if alias else set()
        max_len = self.engine.config.max_model_len
        tags = await asyncio.to_thread(registry.tags, ref)
        base_version = tags.get(BASE_VERSION_TAG, "")
        base = await self.load(name, version=base_version) if base_version else None
        if base is not None and not isinstance(base, ResidentVersion):
            raise NotFound(f"{name}/{base_version}, the base of adapter {ref.version}, is an adapter itself")

        def build() -> Resident:
            resident: Resident
            if base is not None:  # a few MB of adapter: stacked beside the base's, nothing compiled
                resident = load_adapter(directory, ref.version, base, aliases)
            else:
                resident = load_directory(
                    directory,
                    name,
                    ref.version,
                    self.device,
                    aliases=aliases,
                    dtype=self.dtype,
                    max_len=max_len,
                    auto=self.auto_dtype,
                )
            resident.tenant = tags.get(TENANT_TAG, "")
            self.engine.add(resident)  # compiles and warms up first when enabled
            return resident

        resident = await asyncio.to_thread(self.engine.run, build)
        if isinstance(resident, ResidentVersion):
            if resident.dtype_choice is not None and self.engine.metrics is not None:
                self.engine.metrics.observe_dtype_choice(name, ref.version, resident.dtype_choice)
            await self._add_variants(resident, tags, directory)
        else:  # an adapter's one copy is its base's reference, measured (or not) with it
            resident.task_scores = task_scores(tags, resident.copies.values())
        logger.info("loaded model=%s version=%s alias=%s device=%s", name, ref.version, alias, self.device)
        return resident

    async def _add_variants(self, version: ResidentVersion, tags: dict[str, str], directory: Path) -> None:
        """Builds the variants of a version with weights of its own (its checkpoint in `directory`)
        beside it, then measures its copies against its reference (without variants to build,
        nothing is measured); each copy's task score comes from the version's tags."""

        def build(name: str) -> Copy:
            variant = make_variant(version, name, directory)
            self.engine.add_variant(version, variant)
            return variant

        names = wanted_variants(version, self.variants)
        variants = [await asyncio.to_thread(self.engine.run, lambda n=name: build(n)) for name in names]
        version.task_scores = task_scores(tags, version.copies.values())
        if not variants:
            return
        await measure_copies(self.engine, version, variants)
        for copy in version.copies.values():
            q = copy.quality
            assert q is not None
            if self.engine.metrics is not None:
                self.engine.metrics.observe_variant(
                    version.name, version.version, copy.name, q, version.task_scores.get(copy.name)
                )
            logger.info(
                "variant model=%s version=%s variant=%s greedy_agreement=%.3f token_agreement=%.3f "
                "prefill_ms_per_token=%.2f decode_ms_per_token=%.1f", version.name, version.version,
                copy.name, q.greedy_agreement, q.token_agreement, q.prefill_ms_per_token,
                q.decode_ms_per_token,
            )  # fmt: skip
