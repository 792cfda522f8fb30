"""Weight-only int8 and int4 copies of a model (workers/models/precision.py): close to the float
layers they replace, each row the same in any batch, the output head kept in int8, the model they
were made from untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.hf import random_adapter
from tests.support.models import tiny_model
from workers.models.lora import LoraConfig
from workers.models.precision import (
    Int4Linear,
    Int8Linear,
    in_precision,
    quantize_linears,
    quantized,
)
from workers.variants import weight_bytes

# Relative error bounds of one layer's output against float32 (||y - y_float|| / ||y_float||) on
# Gaussian weights, about twice what was measured (int8 in groups of 32 0.4%, int4 in groups of 32 6%,
# bfloat16 activations included).
BOUNDS = {"int8": 0.01, "int4": 0.1}


@pytest.mark.parametrize("name", ["int8", "int4"])
@torch.inference_mode()
def test_a_quantized_linear_stays_close_to_the_float_one_and_gives_each_row_the_same_in_any_batch(
    name: str,
) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 96)
    layer = quantized(linear, name)
    assert isinstance(layer, Int4Linear if name == "int4" else Int8Linear)
    x = torch.randn(2, 9, 128)  # [B, T, in]: any leading shape
    y, wanted = layer(x), linear(x)
    assert y.dtype == torch.float32 and y.shape == wanted.shape
    assert ((y - wanted).norm() / wanted.norm()).item() < BOUNDS[name]
    rows = x.reshape(-1, 128)
    together = layer(rows)
    assert all(torch.equal(layer(rows[i : i + 1])[0], together[i]) for i in range(len(rows)))


@pytest.mark.parametrize("name", ["int8", "int4"])
@torch.inference_mode()
def test_bfloat16_rows_give_the_products_of_the_same_rows_widened_in_any_layout(name: str) -> None:
    # a copy of bfloat16 weights hands its rows to the kernel as they are, with no casts
    torch.manual_seed(0)
    layer = quantized(nn.Linear(128, 96, bias=False), name)
    x = torch.randn(9, 2, 128).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (9, 2, 96)
    assert torch.equal(y, layer(x.float()).to(torch.bfloat16))  # the float32 path casts them
    assert torch.equal(layer(x.transpose(0, 1)), y.transpose(0, 1))  # not contiguous: copied first


@pytest.mark.parametrize("inputs", [60, 72, 100])
@pytest.mark.parametrize("name", ["int8", "int4"])
@torch.inference_mode()
def test_a_layer_of_widths_the_kernels_do_not_fill_multiplies_right(name: str, inputs: int) -> None:
    # int4 takes none of these widths and holds them in int8: its last group of inputs short of 32,
    # and 40 outputs short of whole blocks of 16 channels (padded with zero channels)
    torch.manual_seed(0)
    for linear in (nn.Linear(inputs, 96), nn.Linear(inputs, 40, bias=False)):
        layer = quantized(linear, name)
        assert isinstance(layer, Int8Linear) and layer.whole_blocks == (linear.out_features == 96)
        for count in (1, 5, 64):
            rows = torch.randn(count, inputs)
            y, wanted = layer(rows), linear(rows)
            assert y.shape == wanted.shape and ((y - wanted).norm() / wanted.norm()).item() < BOUNDS["int8"]
            assert torch.equal(layer(rows[-1:])[0], y[-1])


def test_a_linear_the_int4_kernel_cannot_take_is_held_in_int8() -> None:
    assert isinstance(quantized(nn.Linear(128, 40), "int4"), Int8Linear)  # 40 outputs: not a multiple of 16
    assert isinstance(quantized(nn.Linear(48, 64), "int4"), Int8Linear)  # 48 inputs: not a multiple of 32


@torch.inference_mode()
def test_an_int4_copy_keeps_its_head_in_int8_and_leaves_its_model_as_it_was() -> None:
    model = tiny_model(0)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    before = model(tokens)
    int4 = in_precision(model, "int4")
    layers = dict(int4.named_modules())  # type: ignore[attr-defined]  # a CausalLM is an nn.Module
    assert isinstance(layers["lm_head"], Int8Linear)
    assert isinstance(layers["model.layers.0.self_attn.qkv_proj"], Int4Linear)  # q, k and v fused
    assert isinstance(layers["model.layers.0.mlp.gate_up_proj"], Int4Linear)
    assert isinstance(layers["model.layers.0.mlp.down_proj"], Int4Linear)
    assert not any(isinstance(m, nn.Linear) for m in layers.values())
    assert int4.dtype == torch.bfloat16  # embeddings, norms and activations: what the kernels multiply

    logits = int4(tokens)
    assert all(torch.equal(int4(tokens[i : i + 1])[0], logits[i]) for i in range(3))  # each row alone
    assert torch.equal(model(tokens), before)  # the reference copy is untouched
    assert isinstance(dict(model.named_modules())["lm_head"], nn.Linear)  # type: ignore[attr-defined]
    assert weight_bytes(int4) < weight_bytes(in_precision(model, "int8")) < weight_bytes(model)


@pytest.mark.parametrize("name", ["int8", "int4"])
@torch.inference_mode()
def test_a_copy_with_fused_projections_gives_the_logits_of_its_layers_quantized_one_by_one(name: str) -> None:
    # q/k/v and gate/up in one product each: per output channel the same quantized weights and the
    # same kernel, so the same bits, with an adapter's update added to each part by its name too
    model = tiny_model(0)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    separate = copy.deepcopy(model)
    quantize_linears(separate, name, model.vocab_size)  # type: ignore[arg-type]  # an nn.Module
    separate.to(torch.bfloat16)  # type: ignore[attr-defined]  # the rest in bfloat16, as in_precision holds it
    fused = in_precision(model, name)
    assert torch.equal(fused(tokens), separate(tokens))
    adapter = random_adapter(model, LoraConfig(), seed=0)  # type: ignore[arg-type]
    adapted = fused(tokens, adapters=adapter.rows(3))
    assert (adapted - fused(tokens)).abs().max() > 0.01  # the adapter matters
    assert torch.equal(adapted, separate(tokens, adapters=adapter.rows(3)))


@pytest.mark.parametrize("name", ["int8", "bfloat16"])
@torch.inference_mode()
def test_a_copy_turns_q_and_k_by_the_float32_table_a_model_loaded_in_bfloat16_holds(name: str) -> None:
    # the built-in family turns q and k in pairs by its table as it is: in bfloat16 it would turn
    # them otherwise than the same weights loaded in bfloat16 do
    model = tiny_model(0)
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    cast = in_precision(model, name)
    assert cast.rope.dtype == torch.float32  # type: ignore[attr-defined]  # a LlamaForCausalLM
    if name == "bfloat16":
        state = {n: t.bfloat16() for n, t in model.state_dict().items()}  # type: ignore[attr-defined]
        loaded = copy.deepcopy(model).load_weights(state)  # type: ignore[attr-defined]
        assert torch.equal(cast(tokens), loaded(tokens))
