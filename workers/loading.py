"""A version in memory: the model and tokenizer of a registered version's files, loaded on a device."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.models.interface import CausalLM, Tokenizer
from workers.models.loader import load_checkpoint
from workers.models.lora import Adapter


@dataclass(frozen=True)
class Quality:
    """A variant as measured when it loaded (workers/quality.py), against its version's reference on
    a fixed prompt set."""

    greedy_agreement: float  # share of the reference's greedy tokens it reproduces; 1 for the reference
    token_agreement: float  # share of them it predicts given the reference's tokens before each
    prefill_ms_per_token: float  # prompt tokens over time to first token, one prompt alone
    decode_ms_per_token: float  # time per later token, one sequence alone
    weight_bytes: int  # of its weights as held (int8 ones packed)
    task_score: float | None = None  # its version's task-score tag for it (reflow.registry); None: none


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
    max_len: int = 0  # longest prompt plus completion, in tokens; 0 = the model's context
    adapter: Adapter | None = None  # a LoRA adapter served over the weights of version `base_version`
    base_version: str = ""
    variant: str = ""  # a variant of the version (workers/variants.py); "" = the version as loaded
    quality: Quality | None = None  # measured against the version as loaded; None until measured
    tenant: str = ""  # the tenant whose own version it is (reflow.registry.TENANT_TAG); "" = anyone's

    banned_tokens: torch.Tensor = field(init=False)  # [V] bool

    def __post_init__(self) -> None:
        self.max_len = self.max_len or self.model.max_seq_len
        vocab_size = self.model.vocab_size
        banned = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        banned[self.tokenizer.never_generated(vocab_size)] = True
        self.banned_tokens = banned


def load_directory(
    directory: Path,
    name: str,
    version: str,
    device: torch.device,
    aliases: set[str] | None = None,
    dtype: torch.dtype | None = None,
    max_len: int = 0,
) -> LoadedModel:
    """Loads the checkpoint in a local directory (safetensors weights, JSON config, tokenizer) in
    `dtype` (None: the architecture's choice, REFLOW_DTYPE=auto), its context capped at `max_len`
    (0: the model's own)."""
    model, tokenizer = load_checkpoint(directory, device, dtype, max_len)
    return LoadedModel(name, version, model, tokenizer, device, aliases or set())


def load_adapter(
    directory: Path, version: str, base: LoadedModel, aliases: set[str] | None = None
) -> LoadedModel:
    """The LoRA adapter in a local directory (PEFT's files) as a version served over `base`'s
    weights, in their dtype; ValueError when it does not fit the base model."""
    adapter = Adapter.load(directory, base.device, base.model.dtype)
    adapter.check(base.model)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    return LoadedModel(
        base.name, version, base.model, base.tokenizer, base.device, aliases or set(),
        max_len=base.max_len, adapter=adapter, base_version=base.version,
    )  # fmt: skip
