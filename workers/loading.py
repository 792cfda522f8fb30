"""Loads a registered version's files onto a device: a version's weights and tokenizer, or a LoRA
adapter attached to a version loaded already (the types are workers/residency.py's)."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.dtype_choice import AutoDtype
from workers.models.llama import serving_layout
from workers.models.loader import load_checkpoint
from workers.models.lora import Adapter
from workers.residency import ResidentAdapter, ResidentVersion


def load_directory(
    directory: Path,
    name: str,
    version: str,
    device: torch.device,
    *,
    aliases: set[str] | None = None,
    dtype: torch.dtype | None = None,
    max_len: int = 0,
    auto: AutoDtype | None = None,
) -> ResidentVersion:
    """Loads the checkpoint in a local directory (safetensors weights, JSON config, tokenizer) in
    `dtype` (None: REFLOW_DTYPE=auto, the dtype `auto` measured fastest here where given, else the
    architecture's choice), its context capped at `max_len` (0: the model's own), laid out for
    serving (`serving_layout`: projections fused, bfloat16 weights packed for this CPU, float32
    weights transposed where that multiplies faster here)."""
    if dtype is None and auto is not None:
        model, tokenizer, choice = auto.load(directory, device, max_len)
    else:
        (model, tokenizer), choice = load_checkpoint(directory, device, dtype, max_len), None
    serving_layout(model)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    return ResidentVersion(name, version, model, tokenizer, device, aliases or set(), dtype_choice=choice)


def load_adapter(
    directory: Path, version: str, base: ResidentVersion, aliases: set[str] | None = None
) -> ResidentAdapter:
    """The LoRA adapter in a local directory (PEFT's files) as a version served over `base`'s
    reference weights, in their dtype; ValueError when it does not fit the base model."""
    adapter = Adapter.load(directory, base.device, base.model.dtype)
    adapter.check(base.model)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    return ResidentAdapter(version, adapter, base, aliases or set())
