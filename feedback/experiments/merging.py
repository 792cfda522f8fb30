"""Promoting an adapter: its base version with the adapter merged in, registered as a full version.

Why merge rather than make the adapter itself the champion: every adapter then sits one level over
a version with weights of its own (what PEFT, vLLM and LoRAX load), the champion's rows pay nothing
for LoRA, and the next fine-tune round trains its adapter over exactly the weights being served.
The merged weights equal base + adapter to float rounding, so greedy text may differ from the
experiment's challenger in rare near-ties; the lineage is in the tags.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from reflow.registry import SOURCE_TAG, Registry, VersionRef
from workers.models.loader import load_checkpoint, save_checkpoint
from workers.models.lora import Adapter

logger = logging.getLogger(__name__)
MERGED = "merge"  # SOURCE_TAG of a version made by merging an adapter into its base
MERGED_FROM_TAG = "reflow.merged_from"  # on a merged version: the adapter version it folds in


def merged_version(registry: Registry, adapter: VersionRef, base_version: str, cache_dir: Path) -> str:
    """The full version that folds `adapter` into `base_version`'s weights, registered once (a
    promotion retried after a crash finds the one it made)."""
    name = adapter.name
    if (found := registry.find_version(name, MERGED_FROM_TAG, adapter.version)) is not None:
        return found
    base = registry.resolve(name, version=base_version)
    model, tokenizer = load_checkpoint(registry.download(base, cache_dir), "cpu")
    directory = registry.download(adapter, cache_dir)
    Adapter.load(directory, torch.device("cpu"), torch.float32).merge_into(model)  # type: ignore[arg-type]
    tags = {SOURCE_TAG: MERGED, MERGED_FROM_TAG: adapter.version, "reflow.parent_version": base_version}
    with tempfile.TemporaryDirectory() as tmp:
        params: dict[str, object] = {"merged_from": adapter.version, "base_version": base_version}
        run, source = registry.log_run(
            f"{name}-merge-{adapter.version}", params=params, metrics={},
            model_dir=save_checkpoint(model, tokenizer, Path(tmp)), tags=tags,
        )  # fmt: skip
    ref = registry.register_version(name, run, source, alias="", tags=tags)
    logger.info("merged adapter %s v%s into v%s as v%s", name, adapter.version, base_version, ref.version)
    return ref.version
