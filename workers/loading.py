"""A version in memory: the model and tokenizer of a registered version, fetched and loaded on a device."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reflow.registry import Registry, VersionRef
from workers.models.interface import CausalLM, Tokenizer
from workers.models.loader import load_checkpoint


@dataclass
class LoadedModel:
    """A version in memory, ready to generate."""

    name: str
    version: str
    model: CausalLM
    tokenizer: Tokenizer
    device: torch.device
    aliases: set[str] = field(default_factory=set)
    last_request: float = field(default_factory=time.monotonic)  # when a Generate last asked for it

    banned_tokens: torch.Tensor = field(init=False)  # [V] bool

    def __post_init__(self) -> None:
        vocab_size = self.model.vocab_size
        banned = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        banned[self.tokenizer.never_generated(vocab_size)] = True
        self.banned_tokens = banned

    @property
    def max_len(self) -> int:
        """Longest prompt plus completion, in tokens."""
        return self.model.max_seq_len


def load_directory(
    directory: Path, name: str, version: str, device: torch.device, aliases: set[str] | None = None
) -> LoadedModel:
    """Loads the checkpoint in a local directory (safetensors weights, JSON config, tokenizer)."""
    model, tokenizer = load_checkpoint(directory, device)
    return LoadedModel(name, version, model, tokenizer, device, aliases or set())


def load_version(
    registry: Registry, ref: VersionRef, cache_dir: Path, device: torch.device, alias: str = ""
) -> LoadedModel:
    """Fetches `ref` from the registry (cached) and loads it onto `device`."""
    directory = registry.download(ref, cache_dir)
    return load_directory(directory, ref.name, ref.version, device, {alias} if alias else set())
