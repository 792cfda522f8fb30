"""Loads a checkpoint directory as the model and tokenizer that implement it, on the chosen device.

A checkpoint is `config.json` and its weights (safetensors) beside the tokenizer's files: what a
registered version carries. The model's implementation is picked by the config's `model_type`,
the tokenizer's by its file; anything else is refused with what reflow implements.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workers.models import builtin
from workers.models.byte_tokenizer import TOKENIZER_FILE, ByteTokenizer
from workers.models.interface import CausalLM, Tokenizer

# config.json's model_type -> how to load such a model (directory, config.json read, device)
ARCHITECTURES: dict[str, Callable[[Path, dict[str, Any], torch.device], CausalLM]] = {
    builtin.MODEL_TYPE: builtin.Transformer.from_checkpoint,
}
# tokenizer.json's type -> the tokenizer it describes
TOKENIZERS: dict[str, Callable[[dict[str, Any]], Tokenizer]] = {"byte": ByteTokenizer.from_spec}


def resolve_device(setting: str) -> torch.device:
    """`auto` is the first CUDA device when present, else the CPU; anything else as given."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"REFLOW_DEVICE={setting} but torch sees no CUDA device; use cpu or auto")
    return device


def load_checkpoint(directory: Path, device: torch.device | str = "cpu") -> tuple[CausalLM, Tokenizer]:
    """The model and tokenizer saved in `directory`, the weights on `device`; ValueError naming
    what is not supported."""
    config = json.loads((directory / builtin.CONFIG_FILE).read_text())
    model_type = config.get("model_type", builtin.MODEL_TYPE)  # the built-in's first configs had none
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{directory} holds a {model_type!r} model; reflow implements {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type](directory, config, torch.device(device)), load_tokenizer(directory)


def load_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer whose files are in `directory`."""
    spec = json.loads((directory / TOKENIZER_FILE).read_text())
    if spec.get("type") not in TOKENIZERS:
        raise ValueError(
            f"{directory / TOKENIZER_FILE} is not a tokenizer reflow implements (the byte tokenizer)"
        )
    return TOKENIZERS[spec["type"]](spec)


def save_checkpoint(model: CausalLM, tokenizer: Tokenizer, directory: Path) -> Path:
    """Writes the model and its tokenizer into `directory` as a registered version carries them."""
    model.save(directory)
    tokenizer.save(directory)
    return directory
