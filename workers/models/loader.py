"""Loads a checkpoint directory as the model and tokenizer that implement it, on the chosen device
and dtype.

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

from workers.models import builtin, llama
from workers.models.byte_tokenizer import TOKENIZER_FILE, ByteTokenizer
from workers.models.hf_tokenizer import HFTokenizer
from workers.models.interface import CausalLM, Tokenizer

# config.json's model_type -> how to load such a model (directory, config.json read, device,
# dtype or None for the saved one, context cap or 0)
Architecture = Callable[[Path, dict[str, Any], torch.device, torch.dtype | None, int], CausalLM]
ARCHITECTURES: dict[str, Architecture] = {
    builtin.MODEL_TYPE: builtin.from_checkpoint,
    **dict.fromkeys(llama.MODEL_TYPES, llama.LlamaForCausalLM.from_checkpoint),
}
DTYPES = ("auto", *llama.DTYPES)  # REFLOW_DTYPE's values


def resolve_device(setting: str) -> torch.device:
    """`auto` is the first CUDA device when present, else the CPU; anything else as given."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"REFLOW_DEVICE={setting} but torch sees no CUDA device; use cpu or auto")
    return device


def resolve_dtype(setting: str) -> torch.dtype | None:
    """REFLOW_DTYPE: a torch dtype, or None for `auto`, which each architecture decides (the
    built-in model float32, as trained; Llama-family models by device, see `llama.auto_dtype`)."""
    return None if setting == "auto" else llama.DTYPES[setting]


def load_checkpoint(
    directory: Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, max_len: int = 0
) -> tuple[CausalLM, Tokenizer]:
    """The model and tokenizer saved in `directory`, the weights on `device` in `dtype` (None: the
    architecture's choice), its context capped at `max_len` (0: the model's own); ValueError naming
    what is not supported."""
    config = read_config(directory)
    kind = model_type(directory, config)
    if kind not in ARCHITECTURES:
        raise ValueError(
            f"{directory} holds a {kind!r} model; reflow implements {', '.join(sorted(ARCHITECTURES))}"
        )
    model = ARCHITECTURES[kind](directory, config, torch.device(device), dtype, max_len)
    return model, load_tokenizer(directory)


def read_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's `config.json`; ValueError naming the file when it is no JSON object."""
    path = directory / llama.CONFIG_FILE
    try:
        config = json.loads(path.read_bytes())
    except ValueError as error:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not the object of a model's config")
    return config


def model_type(directory: Path, config: dict[str, Any] | None = None) -> str:
    """The architecture a checkpoint's `config.json` names (read unless given)."""
    config = config if config is not None else read_config(directory)
    return str(config.get("model_type", builtin.MODEL_TYPE))  # the built-in's first configs had none


def check_checkpoint(directory: Path) -> None:
    """Loads what a worker would load of `directory` without its weights (their names only, for a
    Llama-family model; the small built-in model in full); ValueError naming what does not fit,
    a config.json that lacks a field or gives one of the wrong type among it."""
    config = read_config(directory)
    llama_family = config.get("model_type") in llama.MODEL_TYPES
    try:
        if llama_family:
            llama.LlamaForCausalLM.skeleton(directory, config)
        else:
            load_checkpoint(directory)
    except (KeyError, TypeError, AttributeError) as error:  # a field missing, or of the wrong type
        raise ValueError(
            f"config.json does not describe a model reflow can build ({type(error).__name__}: {error}); "
            "compare it with the config.json transformers writes for the architecture"
        ) from None
    if llama_family:
        load_tokenizer(directory)


def load_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer whose files are in `directory`: the byte tokenizer, or a Hugging Face one."""
    path = directory / TOKENIZER_FILE
    spec = json.loads(path.read_text())
    if spec.get("type") == "byte":
        return ByteTokenizer.from_spec(spec)
    if "model" in spec:  # what the `tokenizers` library writes
        try:
            return HFTokenizer.from_directory(directory)
        except Exception as error:  # the tokenizers library raises bare Exceptions for bad files
            raise ValueError(f"{path} is not a tokenizer reflow can read: {error}") from error
    raise ValueError(f"{path} is neither the byte tokenizer nor a Hugging Face tokenizer")


def save_checkpoint(model: CausalLM, tokenizer: Tokenizer, directory: Path) -> Path:
    """Writes the model and its tokenizer into `directory` as a registered version carries them."""
    model.save(directory)
    tokenizer.save(directory)
    return directory
