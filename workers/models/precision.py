"""A model's weights in another precision: how a version's variants (workers/variants.py) are made,
and how the fine-tune job scores them on its task before they are ever served.

`int8` is torch's dynamic quantization of the linear layers, the output head included: weights
int8 per output channel, activations quantized per forward at run time (fbgemm on x86 CPUs), the
MLPs' output projections left float (FLOAT_LINEARS). Measured on SmolLM2-135M on 2 cores, its
GEMMs take 0.3-0.6x the float32 time at 16 rows and the 49152-wide head 0.13x at one row. Its
activations are quantized per forward, so its rows depend on the batch they share; and it exists
on the CPU only. `bfloat16` and `float16` are casts of every weight, for CUDA (on a CPU without
native kernels they are slower). The same weights always give the same variant.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from workers.models.interface import CausalLM

# The MLPs' output projections take SwiGLU's massive activations, hundreds of times the rest, which
# one activation scale per tensor flattens: on SmolLM2-135M, quantizing them changed the first greedy
# token of 6 prompts out of 6; left float, of 1.
FLOAT_LINEARS = ("down_proj",)


def in_precision(model: CausalLM, name: str) -> CausalLM:
    """A copy of `model` with its weights in `name` (`int8`, or a float dtype's name)."""
    copied = copy.deepcopy(model)
    return _quantized(copied) if name == "int8" else copied.to(getattr(torch, name))  # type: ignore[attr-defined]


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
