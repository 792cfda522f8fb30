"""A GGUF file imports as the Hugging Face checkpoint transformers itself makes of it: the same logits,
greedy tokens, token ids, special tokens and chat prompt; what it cannot convert is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from workers.models.gguf_checkpoint import gguf_tensor_bytes, gguf_to_checkpoint
from workers.models.greedy import greedy_answers
from workers.models.loader import load_checkpoint

transformers = pytest.importorskip("transformers")  # the reference only; reflow's runtime never imports it

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln — naïve café, 東京は日本の首都です。 Привет, мир! مرحبا بالعالم",
    "Emoji: 🤗🚀👩‍👩‍👧‍👦 🇫🇷 ✨  double  spaces\ttabs\nnew\n\nlines",
    'def add(a: int, b: int) -> int:\n    """Sum."""\n    return a + b  # 1234567 <|im_end|>\n',
]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def converted(smollm2: Path) -> Path:
    """SmolLM2's GGUF file as reflow converts it."""
    return smollm2


@pytest.fixture(scope="module")
def reference_model(smollm2_by_transformers: Path) -> torch.nn.Module:
    """transformers' own reading of the GGUF file, float32."""
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_by_transformers).eval()


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_by_transformers: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(smollm2_by_transformers)


def test_the_files_describe_smollm2(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert (config["vocab_size"], config["tie_word_embeddings"], config["rope_theta"]) == (
        49152,
        True,
        100000.0,
    )
    assert "rope_scaling" not in config
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    header_size = int.from_bytes((converted / "model.safetensors").read_bytes()[:8], "little")
    with (converted / "model.safetensors").open("rb") as file:
        header = json.loads(file.read(8 + header_size)[8:])
    assert "lm_head.weight" not in header and len(header) == 1 + 272
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {"F32"}


def test_the_model_gives_the_logits_and_greedy_tokens_of_the_gguf(
    converted: Path,
    reference_model: torch.nn.Module,
    reference_tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    prompts = [
        *TEXTS[:2],
        reference_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
    ]
    reference = reference_model
    model = transformers.AutoModelForCausalLM.from_pretrained(converted)
    assert reference.dtype == model.dtype == torch.float32
    weights, expected_weights = model.state_dict(), reference.state_dict()
    assert weights.keys() == expected_weights.keys()
    assert all(torch.equal(weights[name], expected_weights[name]) for name in weights)
    with torch.inference_mode():
        for prompt in prompts:
            ids = reference_tokenizer(prompt, return_tensors="pt").input_ids
            expected, logits = reference(ids).logits, model(ids).logits
            assert (logits - expected).abs().max().item() <= 1e-5, prompt
            greedy = {"max_new_tokens": 16, "do_sample": False}
            assert torch.equal(model.generate(ids, **greedy), reference.generate(ids, **greedy)), prompt
    del model


@torch.inference_mode()
def test_reflow_serves_the_imported_file_with_the_logits_and_chat_answer_of_transformers(
    converted: Path,
    reference_model: torch.nn.Module,
    reference_tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    model, tokenizer = load_checkpoint(converted)
    prompt = tokenizer.render_chat(CHAT)
    assert prompt == reference_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, bos=False)
    assert ids == reference_tokenizer(prompt, add_special_tokens=False).input_ids
    expected = reference_model(torch.tensor([ids])).logits
    assert (model(torch.tensor([ids])) - expected).abs().max().item() <= 1e-4
    generated = reference_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[
        0, len(ids) :
    ]
    assert tokenizer.encode(prompt) == ids  # SmolLM2 adds no bos: greedy_answers' encoding is the same
    answer = greedy_answers(model, tokenizer, [prompt], max_new_tokens=24)[0]
    assert answer == reference_tokenizer.decode(generated, skip_special_tokens=True)


def test_the_tokenizer_is_the_one_transformers_builds_from_the_gguf(
    converted: Path, reference_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    runtime = Tokenizer.from_file(str(converted / "tokenizer.json"))  # as reflow loads it, no transformers
    for text in TEXTS:
        expected = reference_tokenizer(text).input_ids
        assert tokenizer(text).input_ids == expected, text
        assert runtime.encode(text).ids == expected, text
        assert (
            tokenizer.decode(expected)
            == reference_tokenizer.decode(expected)
            == runtime.decode(expected, skip_special_tokens=False)
        )
    assert tokenizer.special_tokens_map == reference_tokenizer.special_tokens_map
    assert tokenizer.all_special_ids == reference_tokenizer.all_special_ids
    assert {index: str(token) for index, token in tokenizer.added_tokens_decoder.items()} == {
        index: str(token) for index, token in reference_tokenizer.added_tokens_decoder.items()
    }
    assert (tokenizer.add_bos_token, tokenizer.add_eos_token) == (False, False)
    rendered = reference_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == rendered
    assert json.loads(runtime.to_str()) == json.loads(reference_tokenizer.backend_tokenizer.to_str())


def _tiny_gguf(path: Path, architecture: str, tokenizer_model: str = "gpt2") -> Path:
    """A two-layer model of `architecture` with random float32 weights and a byte-level vocabulary."""
    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, ffn = 64, 4, 2, 96
    # transformers reads no head size for qwen2/qwen3: Qwen2's is hidden / heads, Qwen3's its default 128
    head_dim = {"qwen2": hidden // heads, "qwen3": 128}.get(architecture, 32)
    tokens = ["<|endoftext|>", *(chr(c) for c in range(ord("!"), ord("~") + 1)), "Ġ", "Ġt", "he", "<think>"]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre({"llama": "llama-bpe", "qwen2": "qwen2"}.get(architecture, "default"))
    writer.add_add_bos_token(architecture == "llama")
    writer.add_token_list(tokens)
    types = (
        [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.USER_DEFINED]
    )
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32) * 0.2)

    add("token_embd.weight", len(tokens), hidden)
    add("output_norm.weight", hidden)
    for layer in range(2):
        for name, shape in [
            ("attn_norm", (hidden,)),
            ("ffn_norm", (hidden,)),
            ("attn_q", (heads * head_dim, hidden)),
            ("attn_k", (kv_heads * head_dim, hidden)),
            ("attn_v", (kv_heads * head_dim, hidden)),
            ("attn_output", (hidden, heads * head_dim)),
            ("ffn_gate", (ffn, hidden)),
            ("ffn_up", (ffn, hidden)),
            ("ffn_down", (hidden, ffn)),
        ]:
            add(f"blk.{layer}.{name}.weight", *shape)
        if architecture == "qwen2":
            for name, size in [("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim)]:
                add(f"blk.{layer}.{name}.bias", size)
            add(f"blk.{layer}.attn_v.bias", kv_heads * head_dim)
        if architecture == "qwen3":
            add(f"blk.{layer}.attn_q_norm.weight", head_dim)
            add(f"blk.{layer}.attn_k_norm.weight", head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_each_supported_architecture_converts_to_the_model_transformers_loads(
    architecture: str, tmp_path: Path
) -> None:
    path = _tiny_gguf(tmp_path / f"{architecture}.gguf", architecture)
    converted_bytes: list[int] = []  # what a progress bar is told: each tensor's bytes as it is written
    gguf_to_checkpoint(path, tmp_path / "converted", converted_bytes.append)
    tensors = 2 + 2 * (9 + {"llama": 0, "qwen2": 3, "qwen3": 2}[architecture])
    assert len(converted_bytes) == tensors and sum(converted_bytes) == gguf_tensor_bytes(path)
    reference, reference_loading = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, output_loading_info=True
    )
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "converted", output_loading_info=True
    )
    assert type(model) is type(reference)
    for info in (reference_loading, loading):  # every weight loaded from the file, none left initialized
        assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.arange(1, 40).unsqueeze(0)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    # a split regex, BOS added or not, a user-defined token: still the tokenizer transformers builds
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name).backend_tokenizer
    tokenizer = Tokenizer.from_file(str(tmp_path / "converted" / "tokenizer.json"))
    assert json.loads(tokenizer.to_str()) == json.loads(expected.to_str())
    assert tokenizer.encode("<think>he 123 the").ids == expected.encode("<think>he 123 the").ids


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b'{"not": "gguf"}' * 4)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a GGUF file"):
        gguf_to_checkpoint(path, tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


def test_an_unsupported_architecture_or_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds a 'gemma2' model; GGUF import supports llama, qwen2, qwen3"):
        gguf_to_checkpoint(_tiny_gguf(tmp_path / "gemma2.gguf", "gemma2"), tmp_path / "converted")
    with pytest.raises(ValueError, match="has a 'llama' tokenizer; GGUF import supports gpt2"):
        gguf_to_checkpoint(_tiny_gguf(tmp_path / "spm.gguf", "llama", "llama"), tmp_path / "converted")
    assert not (tmp_path / "converted").exists()
