"""The variants of a loaded version (REFLOW_VARIANTS): its weights again in another precision, a
faster and less exact copy served beside it, with its own KV pool, and how close each comes to the
version as loaded (the reference).

`int8` is torch's dynamic quantization of the linear layers, the output head included: weights
int8 per output channel, activations quantized per forward at run time (fbgemm on x86 CPUs), the
MLPs' output projections left float (FLOAT_LINEARS). Measured on SmolLM2-135M on 2 cores, its
GEMMs take 0.3-0.6x the float32 time at 16 rows and the 49152-wide head 0.13x at one row. Its
activations are quantized per forward, so unlike the reference its rows depend on the batch they
share; and it exists on the CPU only. `bfloat16` and `float16` are casts of every weight, for CUDA
(on a CPU without native kernels they are slower).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import torch
from torch import nn

from workers.loading import LoadedModel
from workers.models.interface import CausalLM

# The MLPs' output projections (Hugging Face's and the built-in model's names) take SwiGLU's massive
# activations, hundreds of times the rest, which one activation scale per tensor flattens: on
# SmolLM2-135M, quantizing them changed the first greedy token of 6 prompts out of 6; left float, of 1.
FLOAT_LINEARS = ("down_proj", "w2")


def variant_name(loaded: LoadedModel) -> str:
    """What a variant is called on the wire: `int8`, or the dtype of a float one."""
    return loaded.variant or str(loaded.model.dtype).removeprefix("torch.")


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
    model = copy.deepcopy(reference.model)
    model = _quantized(model) if name == "int8" else model.to(getattr(torch, name))  # type: ignore[attr-defined]
    return replace(reference, model=model, variant=name, quality=None, aliases=set())


def _quantized(model: CausalLM) -> CausalLM:
    with warnings.catch_warnings():  # torch.ao's eager API is deprecated for torchao, not removed
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        linears = [
            name for name, module in model.named_modules()  # type: ignore[attr-defined]  # an nn.Module
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in FLOAT_LINEARS
        ]  # fmt: skip
        spec = dict.fromkeys(linears, per_channel_dynamic_qconfig)
        return quantize_dynamic(model, spec, dtype=torch.qint8)


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the weights as they are held: packed int8 ones counted as they are stored."""
    state = model.state_dict()  # type: ignore[attr-defined]  # a CausalLM is an nn.Module
    tensors = [
        t for value in state.values()  # a dynamic quantized linear's is a packed (weight, bias)
        for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor)
    ]  # fmt: skip
    held = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}  # tied weights once
    return sum(held.values())
