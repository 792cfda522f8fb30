"""What a decode step can reach at best where it is bound by reading memory: the bytes a step of a
model reads once (its weights) and the rate at which this machine reads them. real_model.py and
peers.py divide the one by the other, measured in the same run as the tokens/s they compare it to."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from workers.models.llama import LlamaForCausalLM
from workers.variants import weight_bytes


def read_bandwidth(device: torch.device) -> float:
    """Bytes a second this device reads: the median of 5 sums over 1 GiB (on the CPU: 256 MiB),
    each after one warm-up; what a decode step that reads its weights once can reach at best."""
    n = (2**30 if device.type == "cuda" else 2**28) // 4
    data = torch.ones(n, device=device)
    times = []
    for _ in range(6):
        synchronize(device)
        started = time.perf_counter()
        data.sum()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 4 * n / statistics.median(times[1:])


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued kernels (a CUDA device's; the CPU's have run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bytes_read_a_step(model: LlamaForCausalLM) -> int:
    """Bytes of `model`'s weights one decode step reads: all it holds (`variants.weight_bytes`) but
    the input embeddings where the output head holds weights of its own (a step reads one row of
    that table)."""
    table = model.model.embed_tokens.weight
    shared = getattr(model.lm_head, "weight", None) is table
    return weight_bytes(model) - (0 if shared else table.numel() * table.element_size())


def gguf_bytes(path: Path) -> int:
    """Bytes of the tensors of a GGUF file, as its reader holds them (llama.cpp reads them all a
    step, SmolLM2's tied embeddings being its output head)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)
