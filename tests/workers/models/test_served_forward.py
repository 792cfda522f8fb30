"""The served forward (served_forward.py): where a worker's forwards take it, it gives the logits and
writes the keys and values of the modules' forward bit for bit, for every copy a worker serves and
every layout of a step's tokens, its layers in one C++ call where every product is paired or int8
in reflow's kernel (decoder_layers.cpp); elsewhere the modules compute."""

from __future__ import annotations

import gc
import itertools
import json
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support.hf import VOCAB, tiny_checkpoint
from workers.models import llama, native
from workers.models.kv_cache import PagedKVCache
from workers.models.linears import PackedLinear, replace_layer
from workers.models.llama import LlamaForCausalLM, fuse_projections, serving_layout
from workers.models.precision import QUANTIZED, in_precision, quantized
from workers.models.served_forward import served_forward, serves

ARCHITECTURES = {  # name -> (transformers config class, model class, what sets it apart)
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-qkv-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
}
COPIES = ["float32", "bfloat16", "float16", "int8", "int4"]  # a worker's: a dtype, or a variant of bfloat16
PAIRED = "bfloat16-paired"  # bfloat16 with every layer's products paired, as where pairs are faster
needs_pairs = pytest.mark.skipif(
    not native.multiplies_pairs(), reason="reflow's paired bfloat16 kernel needs AVX-512 BF16 and g++"
)
CPU = torch.device("cpu")
# A step as the runner makes them: a prompt's first 5 tokens, a sequence decoding its 18th token and
# one verifying 3 drafted tokens at positions 9 to 11
POSITIONS = [[0, 1, 2, 3, 4], [17], [9, 10, 11]]

pytestmark = pytest.mark.skipif(
    not native.available(torch.bfloat16), reason="needs a C++ compiler (g++) to build the kernels"
)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config_class, model_class, extra = ARCHITECTURES[request.param]
    return tiny_checkpoint(  # an MLP as wide as the paired layers take (native.SILU_ROW)
        tmp_path_factory.mktemp(request.param), config_class, model_class, intermediate_size=128, **extra
    )


def served_model(directory: Path, copy: str) -> LlamaForCausalLM:
    """The model as a worker serves `copy` of it: laid out, then quantized for a variant (of a
    version in float32, the copy in bfloat16 all the same)."""
    config = json.loads((directory / "config.json").read_text())
    dtype = torch.float32 if copy in QUANTIZED else torch.bfloat16 if copy == PAIRED else getattr(torch, copy)
    model = LlamaForCausalLM.from_checkpoint(directory, config, CPU, dtype)
    if copy == PAIRED:  # whatever the timing of these tiny shapes would choose
        fuse_projections(model)
        for path, linear in list(model.model.layers.named_modules()):
            if isinstance(linear, nn.Linear):
                replace_layer(model, f"model.layers.{path}", PackedLinear(linear, paired=True))
        return model
    serving_layout(model)
    return in_precision(model, copy) if copy in QUANTIZED else model  # type: ignore[return-value]


def step(
    model: LlamaForCausalLM, layout: str, way: str, monkeypatch: pytest.MonkeyPatch, at: bool = False
) -> tuple[torch.Tensor, PagedKVCache]:
    """One step's logits (all tokens', or at each sequence's last token with `at`) and its pool
    afterwards, `served` or through the `modules`: the step's tokens in one of the runner's two
    layouts, rows padded to the longest ([B, T]) or each token a row of its own ([N, 1]), over a
    pool of random keys and values as earlier tokens left them, each sequence's blocks spread
    through it."""
    generator = torch.Generator().manual_seed(0)
    cache = model.new_cache(1 + 2 * len(POSITIONS))
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    blocks = (1 + torch.randperm(2 * len(POSITIONS), generator=generator)).tolist()
    tables = [blocks[2 * row : 2 * row + 2] for row in range(len(POSITIONS))]
    ids = [torch.randint(2, VOCAB, (len(row),), generator=generator) for row in POSITIONS]
    if layout == "padded":
        view = cache.view(tables, POSITIONS, CPU)
        width = max(map(len, POSITIONS))
        tokens = torch.stack([torch.cat([row, row.new_zeros(width - len(row))]) for row in ids])
        last = [row * width + len(positions) - 1 for row, positions in enumerate(POSITIONS)]
    else:
        view = cache.packed_view(tables, POSITIONS, CPU)
        tokens = torch.cat(ids)[:, None]
        last = [end - 1 for end in itertools.accumulate(map(len, POSITIONS))]
    calls: list[LlamaForCausalLM] = []
    with monkeypatch.context() as patch, torch.inference_mode():
        if way == "modules":
            patch.setattr(llama, "serves", lambda *_: False)
        else:
            patch.setattr(
                llama, "served_forward", lambda m, *rest: calls.append(m) or served_forward(m, *rest)
            )
        logits = model(tokens, cache, view, at=torch.tensor(last) if at else None)
    assert calls == ([model] if way == "served" else [])  # the forward took the way asked
    return logits, cache


def assert_same_step(model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Served and through the modules, a step gives the same logits and leaves the same pool, in
    either layout, with or without `at`."""
    for layout in ("padded", "packed"):
        for at in (False, True):
            served, served_cache = step(model, layout, "served", monkeypatch, at)
            modules, modules_cache = step(model, layout, "modules", monkeypatch, at)
            assert torch.equal(served, modules), (layout, at, (served - modules).abs().max())
            assert torch.equal(served_cache.k, modules_cache.k) and torch.equal(
                served_cache.v, modules_cache.v
            )


@pytest.mark.parametrize("copy", [*COPIES, pytest.param(PAIRED, marks=needs_pairs)])
def test_a_served_step_gives_the_modules_bits_for_every_copy_and_layout(
    checkpoint: Path, copy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_same_step(served_model(checkpoint, copy), monkeypatch)


def test_a_layer_replaced_after_a_served_step_is_the_one_the_next_step_runs(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = served_model(checkpoint, "bfloat16")
    before, _ = step(model, "packed", "served", monkeypatch)  # binds the model's layers
    copy = in_precision(model, "int8")  # a deep copy: it binds its own layers
    assert not torch.equal(step(copy, "packed", "served", monkeypatch)[0], before)
    assert_same_step(copy, monkeypatch)
    down = model.model.layers[0].mlp.down_proj  # packed where oneDNN multiplies bfloat16 here
    replace_layer(
        model, "model.layers.0.mlp.down_proj", quantized(getattr(down, "unpacked", lambda: down)(), "int4")
    )
    assert not torch.equal(step(model, "packed", "served", monkeypatch)[0], before)
    assert_same_step(model, monkeypatch)


def test_the_modules_compute_where_the_served_forward_does_not_apply(
    checkpoint: Path, tmp_path: Path
) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    loaded = LlamaForCausalLM.from_checkpoint(checkpoint, config, CPU, torch.bfloat16)
    cache = loaded.new_cache(4)
    view = cache.view([[1]], [[0]], CPU)
    with torch.inference_mode():
        assert not serves(loaded, cache, view)  # not laid out for serving: projections apart
        serving_layout(loaded)
        assert serves(loaded, cache, view)
        assert not serves(loaded, None, None)  # a training pass: no cache
    with torch.enable_grad():
        assert not serves(loaded, cache, view)  # a fine-tune's forward: autograd records it
    qwen3 = tiny_checkpoint(tmp_path, "Qwen3Config", "Qwen3ForCausalLM", head_dim=32)
    model = LlamaForCausalLM.from_checkpoint(qwen3, json.loads((qwen3 / "config.json").read_text()), CPU)
    serving_layout(model)
    with torch.inference_mode():
        assert not serves(model, model.new_cache(4), view)  # per-head q and k norms


def test_a_model_that_served_is_freed_once_nothing_else_holds_it(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = served_model(checkpoint, "int4")
    step(model, "packed", "served", monkeypatch)  # binds its layers
    freed = weakref.ref(model)
    del model
    gc.collect()
    assert freed() is None  # a swapped-out version's weights go with it


@pytest.mark.parametrize("copy", [pytest.param(PAIRED, marks=needs_pairs), "int8"])
def test_layers_of_one_kernel_run_in_one_call_and_write_the_cache_the_modules_write(
    checkpoint: Path, copy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = served_model(checkpoint, copy)
    calls = []
    one_call = native.DecoderLayers.__call__
    monkeypatch.setattr(native.DecoderLayers, "__call__", lambda *args: calls.append(args) or one_call(*args))
    assert_same_step(model, monkeypatch)
    assert len(calls) == 4  # each layout's served steps, with and without `at`
    assert all(layers.int8 == (copy == "int8") for layers, *_ in calls)  # int8 products, or paired
    calls.clear()
    path, down = "model.layers.1.mlp.down_proj", model.model.layers[1].mlp.down_proj
    if copy == PAIRED:
        replace_layer(model, path, down.unpacked())
    else:  # an int4 layer: torch's kernel
        int4 = quantized(nn.Linear(down.in_features, down.out_features), "int4")
        replace_layer(model, path, int4.bfloat16())
    assert_same_step(model, monkeypatch)  # one product not of the kernel: the layers run one call at a time
    assert calls == []


def test_the_silu_table_holds_torchs_silu_of_each_value_as_a_served_mlp_computes_it() -> None:
    width = native.SILU_ROW * 2
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.bfloat16).view(-1, width)
    gate_up = torch.cat([gates, gates], dim=1)  # [N, 2 * width], gate then up, as a served gate/up product
    with torch.inference_mode():
        silu = torch.nn.functional.silu(gate_up[:, :width])  # strided, a row at a time
    bits = gate_up[:, :width].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(native.silu_table()[bits].view(torch.int16), silu.view(torch.int16))  # NaNs too
