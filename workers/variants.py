"""The variants of a loaded version (REFLOW_VARIANTS): its weights again in another precision, a
faster and less exact copy served beside it, with its own KV pool, and how close each comes to the
version as loaded (the reference).

How each is made is workers/models/precision.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from reflow.registry import TASK_SCORE_TAG
from workers.loading import LoadedModel
from workers.models.interface import CausalLM
from workers.models.precision import in_precision


def variant_name(loaded: LoadedModel) -> str:
    """What a variant is called on the wire: `int8`, or the dtype of a float one."""
    return loaded.variant or str(loaded.model.dtype).removeprefix("torch.")


def task_score(tags: dict[str, str], variant: LoadedModel) -> float | None:
    """A variant's task score from its version's tags (TASK_SCORE_TAG): its own, or for the version
    as loaded the version's; None where the version has none (or a malformed one)."""
    names = [f"{TASK_SCORE_TAG}.{variant_name(variant)}", *([] if variant.variant else [TASK_SCORE_TAG])]
    for name in names:
        with contextlib.suppress(KeyError, ValueError):
            return float(tags[name])
    return None


def check_variants(names: tuple[str, ...], device: torch.device) -> None:
    """ValueError, in a line an operator can act on, for a variant that cannot exist on `device`."""
    if "int8" in names and device.type != "cpu":
        raise ValueError(
            "REFLOW_VARIANTS=int8 is dynamic quantization, a CPU kernel; on CUDA use bfloat16 or float16"
        )


def wanted_variants(reference: LoadedModel, names: tuple[str, ...]) -> tuple[str, ...]:
    """The variants to build beside `reference`: the names that are not its own, in order."""
    own = variant_name(reference)
    return tuple(dict.fromkeys(n for n in names if n != own))


def make_variant(reference: LoadedModel, name: str) -> LoadedModel:
    """A copy of `reference` with its weights in variant `name`, served as the same version."""
    model = in_precision(reference.model, name)
    return replace(reference, model=model, variant=name, quality=None, aliases=set())


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the weights as they are held: packed int8 ones counted as they are stored."""
    state = model.state_dict()  # type: ignore[attr-defined]  # a CausalLM is an nn.Module
    tensors = [
        t for value in state.values()  # a dynamic quantized linear's is a packed (weight, bias)
        for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor)
    ]  # fmt: skip
    held = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}  # tied weights once
    return sum(held.values())
