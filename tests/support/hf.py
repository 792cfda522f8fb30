"""Tiny random Hugging Face checkpoints, written by transformers itself (the reference the Llama family
is held to), with a word-level tokenizer over their vocabulary; random LoRA adapters over them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch import nn

from workers.models.lora import Adapter, LoraConfig

VOCAB = 128
EOS = 1
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=EOS,
)  # fmt: skip


def transformers() -> Any:
    """The transformers module, a test-only dependency."""
    return pytest.importorskip("transformers", reason="the reference: pip install -e '.[test]'")


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: `<s>`, `</s>`, then w2..w127."""
    vocab = {"<s>": 0, "</s>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def tiny_checkpoint(
    directory: Path, config_class: str = "LlamaConfig", model_class: str = "LlamaForCausalLM", **extra: Any
) -> Path:
    """A random checkpoint of one architecture as transformers saves it, weights spread wide so that
    greedy choices are far from ties, and its tokenizer."""
    library = transformers()
    torch.manual_seed(0)
    reference = getattr(library, model_class)(getattr(library, config_class)(**{**COMMON, **extra}))
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.normal_(0, 0.2)
    reference.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def random_adapter(model: nn.Module, config: LoraConfig, seed: int) -> Adapter:
    """An adapter whose B is no longer zero, as after training: it changes the logits."""
    adapter = Adapter.new(model, config, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, b in adapter.weights.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
    return adapter
