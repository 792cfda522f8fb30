"""Loads a checkpoint directory as the model and tokenizer that implement it, on the chosen device."""

from __future__ import annotations

import torch


def resolve_device(setting: str) -> torch.device:
    """`auto` is the first CUDA device when present, else the CPU; anything else as given."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"REFLOW_DEVICE={setting} but torch sees no CUDA device; use cpu or auto")
    return device
