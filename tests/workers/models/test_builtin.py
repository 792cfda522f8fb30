"""The built-in model: cached decoding matches the full pass; weights round-trip through safetensors;
checkpoints saved before it became a preset of the one decoder load and give the same bits; it
takes LoRA adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor

from tests.support.hf import random_adapter
from tests.support.models import save_model, tiny_model
from workers.models.builtin import TOKENIZER, ModelConfig, from_checkpoint, new_model
from workers.models.interface import CausalLM
from workers.models.llama import CONFIG_FILE, WEIGHTS_FILE
from workers.models.loader import load_checkpoint
from workers.models.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, Adapter, LoraConfig

CPU = torch.device("cpu")


@torch.inference_mode()
def test_cached_decoding_gives_the_logits_of_a_full_pass() -> None:
    model = tiny_model(3)
    tokens = torch.randint(0, 261, (2, 24), generator=torch.Generator().manual_seed(0))
    full = model(tokens)  # [2, 24, V]
    cache = model.new_cache(8)
    tables = [[5, 2], [1, 7]]  # any blocks, in any order
    cpu = torch.device("cpu")
    steps = [model(tokens[:, :10], cache, cache.view(tables, [list(range(10))] * 2, cpu))]
    for i in range(10, 24):
        steps.append(model(tokens[:, i : i + 1], cache, cache.view(tables, [[i]] * 2, cpu)))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


@torch.inference_mode()
def test_sequences_in_different_blocks_do_not_see_each_other() -> None:
    model = tiny_model(3)
    a = torch.tensor([[257, 52, 55, 43, 51, 56, 61]])
    b = torch.tensor([[257, 57, 57, 43, 49, 61, 61]])
    cache = model.new_cache(3)
    cpu = torch.device("cpu")
    model(a, cache, cache.view([[1]], [list(range(7))], cpu))
    model(b, cache, cache.view([[2]], [list(range(7))], cpu))
    nxt = torch.tensor([[65]])
    after_a = model(nxt, cache, cache.view([[1]], [[7]], cpu))
    expected = model(torch.cat([a, nxt], dim=1))[:, -1:]
    torch.testing.assert_close(after_a, expected, rtol=1e-4, atol=1e-5)


def test_weights_round_trip_through_safetensors_without_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model(5)
    model.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([WEIGHTS_FILE, CONFIG_FILE])

    def no_pickle(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights must never be unpickled")

    monkeypatch.setattr(torch, "load", no_pickle)
    loaded = from_checkpoint(tmp_path, json.loads((tmp_path / CONFIG_FILE).read_text()))
    tokens = torch.tensor([[257, 49, 43, 50, 61]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def test_presets_and_config_validation() -> None:
    assert ModelConfig.from_name("arith-small").n_layers == 4
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_name("huge")
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "n_experts": 8})


# What the built-in model saved before it became a preset of the one decoder (workers/models/builtin.py
# at e8a3f51, its own Transformer class): gpt-fast's names, q, k and v stacked in wqkv, and this
# config.json. Registries hold versions in this format; it is still the one written.
SAVED_CONFIG = {
    "model_type": "reflow", "vocab_size": 272, "dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 96,
    "max_seq_len": 64, "rope_base": 10000.0, "norm_eps": 1e-05,
}  # fmt: skip


def saved_checkpoint(directory: Path, seed: int = 0) -> dict[str, Tensor]:
    """Random weights under the saved names, as `Transformer.save` wrote them, with the byte tokenizer."""
    c = SAVED_CONFIG
    dim, hidden = int(c["dim"]), int(c["hidden_dim"])
    shapes = {"tok_embeddings.weight": (272, dim), "norm.weight": (dim,), "output.weight": (272, dim)}
    for i in range(int(c["n_layers"])):
        shapes |= {
            f"layers.{i}.attention_norm.weight": (dim,),
            f"layers.{i}.attention.wqkv.weight": (3 * dim, dim),
            f"layers.{i}.attention.wo.weight": (dim, dim),
            f"layers.{i}.ffn_norm.weight": (dim,),
            f"layers.{i}.feed_forward.w1.weight": (hidden, dim),
            f"layers.{i}.feed_forward.w3.weight": (hidden, dim),
            f"layers.{i}.feed_forward.w2.weight": (dim, hidden),
        }
    generator = torch.Generator().manual_seed(seed)
    state = {
        name: torch.randn(shape, generator=generator) * 0.1 + (len(shape) == 1)
        for name, shape in shapes.items()
    }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(SAVED_CONFIG, indent=2) + "\n")
    TOKENIZER.save(directory)
    return state


def saved_model_logits(state: dict[str, Tensor], tokens: Tensor) -> Tensor:
    """The built-in model as it was written before, in plain torch ops over its saved tensors: one
    GEMM for q, k and v, q and k turned in adjacent feature pairs in float32, causal attention,
    SwiGLU, RMSNorm scaled after the cast; logits [B, T, V] of tokens [B, T]."""
    c = SAVED_CONFIG
    dim, heads, eps = int(c["dim"]), int(c["n_heads"]), float(c["norm_eps"])
    d, (b, t) = dim // heads, tokens.shape
    freqs = 1.0 / (float(c["rope_base"]) ** (torch.arange(d // 2).float() / (d // 2)))
    angles = torch.outer(torch.arange(t).float(), freqs)  # [T, D/2]
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]  # [1, T, 1, D/2]

    def norm(x: Tensor, weight: Tensor) -> Tensor:
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight

    def turn(x: Tensor) -> Tensor:  # [B, T, H, D]
        p = x.float().reshape(b, t, heads, d // 2, 2)
        pairs = [p[..., 0] * cos - p[..., 1] * sin, p[..., 1] * cos + p[..., 0] * sin]
        return torch.stack(pairs, dim=-1).flatten(-2).type_as(x)

    x = F.embedding(tokens, state["tok_embeddings.weight"])  # [B, T, dim]
    for i in range(int(c["n_layers"])):
        w = {name.split(f"layers.{i}.")[1]: v for name, v in state.items() if name.startswith(f"layers.{i}.")}
        qkv = F.linear(norm(x, w["attention_norm.weight"]), w["attention.wqkv.weight"])
        q, k, v = qkv.view(b, t, 3, heads, d).unbind(2)  # each [B, T, H, D]
        q, k, v = (y.transpose(1, 2) for y in (turn(q), turn(k), v))  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(y.transpose(1, 2).reshape(b, t, dim), w["attention.wo.weight"])
        h = norm(x, w["ffn_norm.weight"])
        gated = F.silu(F.linear(h, w["feed_forward.w1.weight"])) * F.linear(h, w["feed_forward.w3.weight"])
        x = x + F.linear(gated, w["feed_forward.w2.weight"])
    return F.linear(norm(x, state["norm.weight"]), state["output.weight"])


@torch.inference_mode()
def test_a_checkpoint_saved_before_the_one_decoder_gives_the_same_bits_and_tokens(tmp_path: Path) -> None:
    state = saved_checkpoint(tmp_path / "saved")
    model, _ = load_checkpoint(tmp_path / "saved")
    tokens = torch.randint(0, 261, (3, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(tokens), saved_model_logits(state, tokens))  # bit for bit, every row

    banned = TOKENIZER.never_generated(model.vocab_size)
    for prompt in ["1+2=", "47+38=", "123+4567="]:
        ids = [TOKENIZER.encode(prompt)] * 2
        for _ in range(12):  # greedy, by cache-free passes of each
            batch = torch.tensor(ids)
            old, new = saved_model_logits(state, batch)[:, -1], model(batch)[:, -1]  # [2, V]
            old[:, banned] = new[:, banned] = float("-inf")
            assert torch.equal(new.argmax(-1), old.argmax(-1))
            ids = [[*row, int(new[0].argmax())] for row in ids]

    model.save(tmp_path / "again")  # written back as it was read
    assert json.loads((tmp_path / "again" / CONFIG_FILE).read_text()) == SAVED_CONFIG
    again = load_file(tmp_path / "again" / WEIGHTS_FILE)
    assert again.keys() == state.keys() and all(torch.equal(again[n], t) for n, t in state.items())


# Greedy ids of freshly initialised built-in models, recorded with workers/models/builtin.py at
# e8a3f51 (its own Transformer class): `new_model(preset, seed)`, 16 tokens by cache-free passes,
# the tokenizer's never-generated ids masked. The same seed still draws the same weights.
RECORDED = {
    ("tiny", 0): {
        "1+2=": [130, 213, 14, 21, 151, 162, 203, 148, 259, 152, 24, 217, 49, 202, 43, 73],
        "47+38=": [130, 153, 204, 259, 152, 24, 217, 49, 204, 259, 152, 24, 63, 30, 196, 239],
        "123+4567=": [130] + [230] * 15,
    },
    ("tiny", 7): {
        "1+2=": [178, 68, 171, 177, 154, 185, 19, 172, 128, 178, 68, 171, 177, 154, 185, 19],
        "47+38=": [144, 20, 45, 118, 214, 250, 23, 112, 255, 242, 33, 130, 160, 193, 165, 144],
        "123+4567=": [178, 173, 178, 173, 101, 19, 118, 182, 160, 171, 177, 154, 185, 19, 118, 112],
    },
    ("arith-small", 0): {
        "1+2=": [77, 124, 77] + [124] * 13,
        "47+38=": [114, 24, 114, 77, 24, 24, 24, 250, 77, 114, 24, 24, 24, 24, 27, 27],
        "123+4567=": [114, 242, 77, 242, 77, 242, 77, 242, 77, 24, 24, 230, 89, 230, 89, 230],
    },
}


@pytest.mark.parametrize(("preset", "seed"), list(RECORDED))
@torch.inference_mode()
def test_new_models_give_the_greedy_tokens_recorded_before_the_one_decoder(preset: str, seed: int) -> None:
    model = new_model(preset, seed)[0].eval()
    banned = TOKENIZER.never_generated(model.vocab_size)
    for prompt, expected in RECORDED[(preset, seed)].items():
        ids = TOKENIZER.encode(prompt)
        for _ in range(16):
            logits = model(torch.tensor([ids]))[0, -1]
            logits[banned] = float("-inf")
            ids.append(int(logits.argmax()))
        assert ids[-16:] == expected


@torch.inference_mode()
def test_the_built_in_model_takes_lora_adapters(tmp_path: Path) -> None:
    model = tiny_model(3)
    batch = torch.randint(0, 261, (3, 12), generator=torch.Generator().manual_seed(2))
    zero = Adapter.new(model, LoraConfig(rank=4))  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    assert torch.equal(model(batch, adapters=zero.rows(3)), model(batch))

    adapter = random_adapter(model, LoraConfig(rank=4, alpha=8), seed=1)  # type: ignore[arg-type]
    adapted: CausalLM = model.adapted(adapter)
    assert adapted.adapter is adapter and (adapted.model_type, adapted.vocab_size) == ("reflow", 272)
    assert adapted.parameter_count() == adapter.parameter_count() < model.parameter_count()
    logits = adapted(batch)
    assert torch.equal(logits, model(batch, adapters=adapter.rows(3)))
    assert not torch.equal(logits, model(batch))

    adapted.save(tmp_path / "adapter")  # the adapter alone, in PEFT's format, over the saved base
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE}
    base, _ = load_checkpoint(save_model(model, tmp_path / "base"))
    loaded = base.adapted(Adapter.load(tmp_path / "adapter", CPU, torch.float32))
    assert torch.equal(loaded(batch), logits)
    adapter.merge_into(model)  # type: ignore[arg-type]
    torch.testing.assert_close(model(batch), logits, rtol=1e-4, atol=1e-5)
