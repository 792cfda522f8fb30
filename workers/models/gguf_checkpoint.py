"""Imports a GGUF file as a Hugging Face checkpoint directory, the form reflow registers models in.

The GGUF metadata becomes `config.json` (as transformers 4 writes it), `generation_config.json` and the
tokenizer's files; every tensor is dequantized to float32 into `model.safetensors` under its Hugging Face
name. The result is the model and tokenizer transformers builds when it loads the GGUF itself
(`from_pretrained(..., gguf_file=...)`), mirrored here without importing transformers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_BASE_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# GGUF architecture -> (Hugging Face class, `blk.N.` tensor -> `model.layers.N.` tensor)
_ARCHITECTURES: dict[str, tuple[str, dict[str, str]]] = {
    "llama": ("LlamaForCausalLM", _BASE_LAYER_TENSORS),
    "qwen2": (
        "Qwen2ForCausalLM",
        _BASE_LAYER_TENSORS
        | {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},  # Qwen2's q/k/v have biases
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        _BASE_LAYER_TENSORS
        | {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
    ),
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
}
_TOKENIZER_MODELS = ("gpt2",)  # byte-level BPE, the only `tokenizer.ggml.model` converted

# `tokenizer.ggml.pre` -> the split regex transformers' GGUF converter puts before the byte-level step;
# any other value keeps GPT-2's own (ByteLevel's built-in regex), as there.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE_TOKENIZERS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0")
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys((*_LLAMA3_PRE_TOKENIZERS, "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of tensor data in the GGUF file at `path`: what the calls to `gguf_to_checkpoint`'s
    `progress` add up to, so a progress bar knows its total."""
    return sum(int(tensor.n_bytes) for tensor in _open(path).tensors)


def gguf_to_checkpoint(path: Path, directory: Path, progress: Callable[[int], None] | None = None) -> None:
    """Writes the model in the GGUF file at `path` into `directory` as a Hugging Face checkpoint:
    `config.json`, `model.safetensors` (float32), `generation_config.json`, `tokenizer.json` and
    `tokenizer_config.json`. `progress` is called after each tensor with the bytes of GGUF tensor data it
    converted. ValueError, before anything is written, for a file that is not GGUF or describes an
    architecture or tokenizer this does not convert."""
    reader = _open(path)
    metadata = _Metadata(path, {name: field.contents() for name, field in reader.fields.items()})
    architecture = metadata["general.architecture"]
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"{path} holds a {architecture!r} model; GGUF import supports {', '.join(_ARCHITECTURES)}"
        )
    tokenizer_model = metadata.get("tokenizer.ggml.model")
    if tokenizer_model not in _TOKENIZER_MODELS or "tokenizer.ggml.merges" not in metadata:
        raise ValueError(
            f"{path} has a {tokenizer_model!r} tokenizer; GGUF import supports {', '.join(_TOKENIZER_MODELS)}"
            " (byte-level BPE, with its merges)"
        )
    hf_names = _hf_names(path, reader.tensors, architecture)
    config = _config(metadata, architecture, tied="lm_head.weight" not in hf_names.values())
    tokenizer, tokenizer_config = _tokenizer(metadata, config["max_position_embeddings"])

    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "config.json", config)
    _write_json(
        directory / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", tokenizer_config)
    _write_weights(reader, hf_names, config, directory / "model.safetensors", progress)


class _Metadata(dict[str, Any]):
    """A GGUF file's metadata; reading a key it lacks is a ValueError naming the key and the file."""

    def __init__(self, path: Path, fields: dict[str, Any]):
        super().__init__(fields)
        self.path = path

    def __missing__(self, key: str) -> Any:
        raise ValueError(f"{self.path} lacks the GGUF metadata {key!r}; it may be damaged, or not a model")


def _open(path: Path) -> GGUFReader:
    """The file's reader; ValueError when it is not GGUF, or not all of it (rather than whatever
    gguf raises on it)."""
    with path.open("rb") as file:
        if file.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes")
    try:
        return GGUFReader(path)
    except Exception as error:  # what numpy raises reading past the end: IndexError, ValueError, ...
        raise ValueError(
            f"{path} is a damaged GGUF file (truncated or corrupt: {error}); download or convert it again"
        ) from None


def _hf_names(path: Path, tensors: list[ReaderTensor], architecture: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name; ValueError naming the tensors that have none."""
    hf_class, layer_tensors = _ARCHITECTURES[architecture]
    names, unknown = {}, []
    for tensor in tensors:
        parts = tensor.name.split(".", 2)  # blk.N.leaf
        if tensor.name in _GLOBAL_TENSORS:
            names[tensor.name] = _GLOBAL_TENSORS[tensor.name]
        elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
            names[tensor.name] = f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
        else:
            unknown.append(tensor.name)
    if unknown:
        # e.g. rope_freqs.weight, Llama 3.1's per-dimension RoPE factors: transformers drops it, which
        # changes the model, and config.json's llama3 rope_scaling cannot be read back from it
        raise ValueError(f"{path} has tensors with no {hf_class} counterpart: {', '.join(unknown)}")
    return names


def _config(metadata: dict[str, Any], architecture: str, tied: bool) -> dict[str, Any]:
    """`config.json` as transformers 4 writes it, from the `<architecture>.*` keys; values as the file
    stores them (a float32 epsilon stays 9.999999747378752e-06), as transformers reads them."""
    prefix = f"{architecture}."
    heads = metadata[prefix + "attention.head_count"]
    head_dim = metadata.get(
        prefix + "attention.key_length",
        metadata.get(prefix + "rope.dimension_count", metadata[prefix + "embedding_length"] // heads),
    )
    config = {
        "architectures": [_ARCHITECTURES[architecture][0]],
        "model_type": architecture,
        "hidden_size": metadata[prefix + "embedding_length"],
        "intermediate_size": metadata[prefix + "feed_forward_length"],
        "num_hidden_layers": metadata[prefix + "block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": metadata.get(prefix + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": metadata[prefix + "attention.layer_norm_rms_epsilon"],
        "rope_theta": metadata.get(prefix + "rope.freq_base", 10000.0),  # llama.cpp's default
        "max_position_embeddings": metadata[prefix + "context_length"],
        "vocab_size": metadata.get(prefix + "vocab_size", len(metadata["tokenizer.ggml.tokens"])),
        "tie_word_embeddings": tied,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    scaling = metadata.get(prefix + "rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": metadata[prefix + "rope.scaling.factor"]}
        if (original := metadata.get(prefix + "rope.scaling.original_context_length")) is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    elif scaling != "none":
        raise ValueError(f"RoPE scaling {scaling!r} is not supported; GGUF import supports linear and yarn")
    return config


def _tokenizer(metadata: dict[str, Any], context_length: int) -> tuple[Tokenizer, dict[str, Any]]:
    """The byte-level BPE tokenizer and `tokenizer_config.json`, built as transformers' GGUF converter
    builds them (`byte_level_tokenizer`, `add_gguf_special_tokens`, `set_split_regex`)."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
    byte_spelling = _byte_spelling()
    alphabet = set(byte_spelling.values())
    # a token spelled outside the byte alphabet is stored as raw text: respell its UTF-8 bytes
    vocab = {
        token if set(token) <= alphabet else "".join(byte_spelling[byte] for byte in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_TOKENIZER_SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    tokenizer.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False)
        if split is None
        else pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    )
    tokenizer.decoder = decoders.ByteLevel()

    # control tokens are special; one spelled outside the byte alphabet is a llama.cpp mislabel, left out
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, token_type in zip(tokens, token_types, strict=False)
            if token_type == TokenType.CONTROL and set(token) <= alphabet
        ]
    )
    # user-defined tokens (`<think>`) are matched whole, but are not special
    known = tokenizer.get_vocab()
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, token_type in zip(tokens, token_types, strict=False)
            if token_type == TokenType.USER_DEFINED and token in known
        ]
    )
    specials = {
        name: tokens[index] if (index := metadata.get(f"tokenizer.ggml.{key}")) is not None else None
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    tokenizer.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token in specials.values()
            if token is not None
        ]
    )
    bos, eos = specials["bos_token"], specials["eos_token"]
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tokenizer.post_processor = _post_processor(tokenizer, bos if add_bos else None, eos if add_eos else None)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as it is, not Llama's sentencepiece
        **specials,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": context_length,  # transformers leaves it unbounded (1e30) for a GGUF
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return tokenizer, config


def _post_processor(tokenizer: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence as the GGUF asks, the template transformers' `update_post_processor`
    writes."""
    first = " ".join(part for part in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if part)
    second = " ".join(part for part in (bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if part)
    return processors.TemplateProcessing(
        single=first,
        pair=f"{first} {second}",
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in (bos, eos) if token is not None],
    )


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> character map (`bytes_to_unicode`): printable bytes are themselves, the others
    are shifted past 255 in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [byte for byte in range(256) if byte not in printable]
    return {byte: chr(byte) for byte in printable} | {byte: chr(256 + n) for n, byte in enumerate(others)}


def _write_weights(
    reader: GGUFReader,
    hf_names: dict[str, str],
    config: dict[str, Any],
    file: Path,
    progress: Callable[[int], None] | None,
) -> None:
    """Streams the tensors into a float32 safetensors file, one dequantized tensor in memory at a time.

    The header is known from the shapes alone, so it is written first and each tensor's bytes follow.
    """
    shapes = {tensor.name: tuple(int(n) for n in reversed(tensor.shape)) for tensor in reader.tensors}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in reader.tensors:
        size = 4 * math.prod(shapes[tensor.name])
        header[hf_names[tensor.name]] = {
            "dtype": "F32",
            "shape": list(shapes[tensor.name]),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it

    # llama.cpp interleaves each head's two rotary halves in q and k; transformers undoes it on loading
    permuted_heads = {
        "attn_q.weight": config["num_attention_heads"],
        "attn_k.weight": config["num_key_value_heads"],
    }
    with file.open("wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for tensor in reader.tensors:
            weights = dequantize(tensor.data, tensor.tensor_type).reshape(shapes[tensor.name])
            heads = permuted_heads.get(tensor.name.split(".", 2)[-1])
            if config["model_type"] == "llama" and heads is not None:  # llama.cpp's qwen2/3 do not permute
                rows, columns = weights.shape
                # (heads * head_dim, columns) -> (heads, head_dim / 2, 2, columns), swapped to
                # (heads, 2, head_dim / 2, columns): each head's two rotary halves contiguous again
                weights = weights.reshape(heads, rows // heads // 2, 2, columns).swapaxes(1, 2)
                weights = weights.reshape(rows, columns)
            out.write(np.ascontiguousarray(weights, dtype="<f4").data)
            if progress is not None:
                progress(int(tensor.n_bytes))


def _write_json(file: Path, content: dict[str, Any]) -> None:
    file.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
