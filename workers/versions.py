"""The versions a worker holds: resolved in the registry, fetched off the event loop while running
sequences keep decoding, then built on the engine's thread and added to it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

import torch

from reflow.errors import NotFound
from reflow.registry import BASE_VERSION_TAG, TENANT_TAG, Registry
from workers.engine import Engine
from workers.loading import LoadedModel, load_adapter, load_directory
from workers.quality import measure
from workers.variants import make_variant, task_score, variant_name, wanted_variants

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
        self.dtype = dtype  # None: each architecture's choice (REFLOW_DTYPE=auto)
        self.variants = variants  # REFLOW_VARIANTS: built beside each version with weights of its own

    async def load(self, name: str, *, version: str = "", alias: str = "") -> LoadedModel:
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

        def build() -> LoadedModel:
            if base is not None:  # a few MB of adapter: stacked beside the base's, nothing compiled
                loaded = load_adapter(directory, ref.version, base, aliases)
            else:
                loaded = load_directory(
                    directory, name, ref.version, self.device, aliases, self.dtype, max_len
                )
            loaded.tenant = tags.get(TENANT_TAG, "")
            self.engine.add(loaded)  # compiles and warms up first when enabled
            return loaded

        loaded = await asyncio.to_thread(self.engine.run, build)
        await self._add_variants(loaded, tags)
        logger.info("loaded model=%s version=%s alias=%s device=%s", name, ref.version, alias, self.device)
        return loaded

    async def _add_variants(self, loaded: LoadedModel, tags: dict[str, str]) -> None:
        """Builds the variants of a version with weights of its own beside it (an adapter is served
        over its base's reference only), then measures them all against it; without variants to
        build, nothing is measured."""
        names = () if loaded.adapter is not None else wanted_variants(loaded, self.variants)
        if not names:
            return

        def build(name: str) -> LoadedModel:
            variant = make_variant(loaded, name)
            self.engine.add(variant)
            return variant

        variants = [await asyncio.to_thread(self.engine.run, lambda n=name: build(n)) for name in names]
        await measure(self.engine, loaded, variants)
        for v in [loaded, *variants]:
            assert v.quality is not None
            v.quality = replace(v.quality, task_score=task_score(tags, v))
            if self.engine.metrics is not None:
                self.engine.metrics.observe_variant(v.name, v.version, variant_name(v), v.quality)
            logger.info(
                "variant model=%s version=%s variant=%s greedy_agreement=%.3f token_agreement=%.3f "
                "prefill_ms_per_token=%.2f decode_ms_per_token=%.1f", v.name, v.version, variant_name(v),
                v.quality.greedy_agreement, v.quality.token_agreement, v.quality.prefill_ms_per_token,
                v.quality.decode_ms_per_token,
            )  # fmt: skip
