"""The variants of a loaded version (REFLOW_VARIANTS): its weights again in another precision, a
faster and less exact copy served beside its reference copy (the version as loaded), with its own
KV pool, and the task score its version's tags give each copy.

How each is made is workers/models/precision.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from reflow.registry import TASK_SCORE_TAG
from workers.models.interface import CausalLM
from workers.models.linears import PackedLinear
from workers.models.llama import MODEL_TYPES, StoredWeights, serving_layout
from workers.models.loader import model_type
from workers.models.precision import QUANTIZED, in_precision
from workers.residency import Copy, ResidentVersion


def task_scores(tags: dict[str, str], copies: Iterable[Copy]) -> dict[str, float]:
    """The task score of each copy its version's tags (TASK_SCORE_TAG) give one, by copy name."""
    scores = {copy.name: task_score(tags, copy) for copy in copies}
    return {name: score for name, score in scores.items() if score is not None}


def task_score(tags: dict[str, str], copy: Copy) -> float | None:
    """A copy's task score from its version's tags: its own, or for the reference the version's;
    None where the version has none (or a malformed one)."""
    names = [f"{TASK_SCORE_TAG}.{copy.name}", *([TASK_SCORE_TAG] if copy.reference else [])]
    for name in names:
        with contextlib.suppress(KeyError, ValueError):
            return float(tags[name])
    return None


def check_variants(names: tuple[str, ...], device: torch.device) -> None:
    """ValueError, in a line an operator can act on, for a variant that cannot exist on `device`."""
    quantized = [n for n in names if n in QUANTIZED]
    if quantized and device.type != "cpu":
        raise ValueError(
            f"REFLOW_VARIANTS={quantized[0]} is weight-only quantization, a CPU kernel; on CUDA use "
            "bfloat16 or float16"
        )


def wanted_variants(version: ResidentVersion, names: tuple[str, ...]) -> tuple[str, ...]:
    """The variants to build beside a version: the names that are not its reference's, in order."""
    own = version.reference.name
    return tuple(dict.fromkeys(n for n in names if n != own))


def make_variant(version: ResidentVersion, name: str, directory: Path | None = None) -> Copy:
    """A copy of a version's reference weights in variant `name`, laid out for serving; a quantized
    one quantized from the version's checkpoint in `directory` where `stored_weights` says so."""
    model = in_precision(version.model, name, stored_weights(version, name, directory))
    serving_layout(model)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    return Copy(name, model, max_len=version.max_len)


def stored_weights(version: ResidentVersion, name: str, directory: Path | None) -> StoredWeights | None:
    """What a copy of `version` in `name` is quantized from, where `name` is QUANTIZED and the
    version is held in fewer bits than float32 (a bfloat16 worker's): the weights its Llama-family
    checkpoint in `directory` stores, read a layer at a time, so that a checkpoint stored in float32
    keeps its bits (SmolLM2-135M's int8 copy agreed with float32 on 0.953 of the worker's tokens so,
    0.945 quantized from bfloat16: docs/models.md). None otherwise: the weights as loaded."""
    quantized_in_fewer_bits = name in QUANTIZED and version.model.dtype != torch.float32
    if directory is None or not quantized_in_fewer_bits or model_type(directory) not in MODEL_TYPES:
        return None
    return StoredWeights(directory)


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the weights as they are held: quantized ones as they are packed, with their scales,
    and packed bfloat16 ones (workers/models/linears.py) besides."""
    module: nn.Module = model  # type: ignore[assignment]  # a CausalLM is an nn.Module
    held = {t.data_ptr(): t.numel() * t.element_size() for t in module.state_dict().values()}  # tied: once
    packed = [m.packed for m in module.modules() if isinstance(m, PackedLinear)]  # not in the state
    return sum(held.values()) + sum(t.numel() * t.element_size() for t in packed)
