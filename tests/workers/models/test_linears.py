"""Linear layers as a worker serves them (workers/models/linears.py): bfloat16 weights packed for
the CPU's oneDNN products or in pairs for reflow's own give each row the same bits in any batch,
stay close to the plain product, unpack to the same weights, and are laid out in a served model
only where they apply."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.models import tiny_model
from tests.support.smollm2 import truncated_smollm2
from workers.loading import load_directory
from workers.models import native
from workers.models.linears import (
    ROW_CHUNK,
    PackedLinear,
    StackedLinear,
    pack_linears,
    paired_is_faster,
    plain_linear,
    rows_for_same_bits,
    transposed_is_faster,
    unpacked_copy,
)
from workers.models.llama import fuse_projections, serving_layout
from workers.models.precision import in_precision
from workers.variants import weight_bytes

BFLOAT16 = torch.bfloat16
needs_bf16_products = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bfloat16 products on this CPU"
)
needs_paired_products = pytest.mark.skipif(
    not native.multiplies_pairs(), reason="reflow's paired bfloat16 kernel needs AVX-512 BF16 and g++"
)


def random_linear(in_features: int, out_features: int, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(BFLOAT16).requires_grad_(False)


@needs_bf16_products
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576)])
@torch.inference_mode()
def test_a_packed_layer_gives_each_row_the_same_bits_in_any_batch_and_stays_close_to_the_plain_one(
    in_features: int, out_features: int
) -> None:
    # SmolLM2's q/k/v and down projections; 1536 inputs are what oneDNN splits between threads
    # from about 150 rows, which the chunks of ROW_CHUNK rows keep out, and what an AMD EPYC
    # rounds differently alone, which padding to 2 rows keeps out
    min_rows = rows_for_same_bits(in_features, out_features, bias=True)
    if min_rows is None:
        pytest.skip("on this CPU a packed product of this shape changes a row's bits with the row count")
    linear = random_linear(in_features, out_features, bias=True)
    packed = PackedLinear(linear, min_rows)
    rows = torch.randn(300, in_features, generator=torch.Generator().manual_seed(1)).to(BFLOAT16)
    alone = torch.cat([packed(rows[i : i + 1]) for i in range(len(rows))])
    for count in (2, 5, 16, 33, 64, ROW_CHUNK, ROW_CHUNK + 1, 150, 200, 300):
        assert torch.equal(packed(rows[:count]), alone[:count]), count
    plain = F.linear(rows, linear.weight, linear.bias).float()
    assert ((alone.float() - plain).norm() / plain.norm()).item() < 0.01  # bfloat16's rounding
    assert packed(rows[:12].view(3, 4, in_features)).shape == (3, 4, out_features)  # any leading shape


@needs_bf16_products
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 128), (96, 64), (576, 960)])
@torch.inference_mode()
def test_a_packed_layer_keeps_each_rows_bits_for_any_weights_and_rows_not_just_its_probe(
    in_features: int, out_features: int
) -> None:
    # the tiny test checkpoints' q/k/v and down projections, and SmolLM2's q/k/v: on a Xeon without
    # AVX-512 BF16 a lone row is summed in another order than a batch's, which in a narrow product
    # changes a bfloat16 output in only some draws of random rows (`order_probe`)
    min_rows = rows_for_same_bits(in_features, out_features, bias=False)
    if min_rows is None:
        pytest.skip("on this CPU a packed product of this shape changes a row's bits with the row count")
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(out_features, in_features, generator=generator).to(BFLOAT16)
        rows = torch.randn(ROW_CHUNK, in_features, generator=generator).to(BFLOAT16)
        packed = PackedLinear(plain_linear(weight, None), min_rows)
        alone = torch.cat([packed(row) for row in rows.split(1)])
        for count in range(2, ROW_CHUNK + 1):
            assert torch.equal(packed(rows[:count]), alone[:count]), (seed, count)


@needs_paired_products
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"), [(576, 960, True), (1536, 576, False), (64, 96, True)]
)
@torch.inference_mode()
def test_a_paired_layer_gives_each_row_the_same_bits_in_any_batch_unpadded_and_stays_close_to_the_plain_one(
    in_features: int, out_features: int, bias: bool
) -> None:
    # SmolLM2's q/k/v and down projections (the down one needs padding in oneDNN's layout on an
    # AMD EPYC), and a tiny one, small enough to run on one thread
    linear = random_linear(in_features, out_features, bias=bias)
    paired = PackedLinear(linear, paired=True)
    rows = torch.randn(300, in_features, generator=torch.Generator().manual_seed(1)).to(BFLOAT16)
    alone = torch.cat([paired(rows[i : i + 1]) for i in range(len(rows))])
    for count in (2, 3, 5, 7, 14, 16, 33, 64, ROW_CHUNK + 1, 300):  # whole tiles of 8 rows and each rest
        assert torch.equal(paired(rows[:count]), alone[:count]), count
    plain = F.linear(
        rows.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float()
    )
    assert ((alone.float() - plain).norm() / plain.norm()).item() < 0.005  # bfloat16's rounding, once
    assert paired(rows[:12].view(3, 4, in_features)).shape == (3, 4, out_features)  # any leading shape
    unpacked = paired.unpacked()
    assert type(unpacked) is nn.Linear and torch.equal(unpacked.weight, linear.weight)
    assert bias == (unpacked.bias is not None) and (not bias or torch.equal(unpacked.bias, linear.bias))


@needs_bf16_products
def test_a_packed_layer_unpacks_to_the_weights_and_parts_it_was_packed_from() -> None:
    parts = {"q": random_linear(64, 32, bias=True, seed=1), "k": random_linear(64, 16, bias=True, seed=2)}
    stacked = StackedLinear.stack(parts)
    unpacked = PackedLinear(stacked).unpacked()
    assert isinstance(unpacked, StackedLinear) and unpacked.parts == {"q": 32, "k": 16}
    assert torch.equal(unpacked.weight, stacked.weight) and torch.equal(unpacked.bias, stacked.bias)
    plain = random_linear(64, 48)
    unpacked_plain = PackedLinear(plain).unpacked()
    assert type(unpacked_plain) is nn.Linear and torch.equal(unpacked_plain.weight, plain.weight)


@needs_bf16_products
@torch.inference_mode()
def test_a_bfloat16_model_is_served_packed_and_its_copies_are_made_from_the_same_weights() -> None:
    loaded = tiny_model(0).to(BFLOAT16)  # type: ignore[attr-defined]  # a CausalLM is an nn.Module
    served = copy.deepcopy(loaded)
    serving_layout(served)
    layers = dict(served.named_modules())
    assert {type(layers[n]) for n in ("lm_head", "model.layers.0.self_attn.qkv_proj")} == {PackedLinear}
    assert not any(isinstance(m, nn.Linear) for m in layers.values())
    for name, layer in layers.items():  # in pairs where this CPU measured them faster, for each shape
        if isinstance(layer, PackedLinear):
            assert layer.paired == paired_is_faster(layer.in_features, layer.out_features), name
    assert isinstance(layers["model.embed_tokens"], nn.Embedding)  # the embeddings stay as loaded
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    logits, expected = served(tokens).float(), loaded(tokens).float()
    assert ((logits - expected).norm() / expected.norm()).item() < 0.02
    assert all(torch.equal(served(tokens[i : i + 1])[0], served(tokens)[i]) for i in range(3))
    assert weight_bytes(served) >= weight_bytes(loaded)  # packed weights count as held (a tied head: twice)
    packed_layers = [m for m in served.modules() if isinstance(m, PackedLinear)]
    serving_layout(served)  # laying out twice changes nothing
    assert packed_layers == [m for m in served.modules() if isinstance(m, PackedLinear)]
    fused = copy.deepcopy(loaded)
    fuse_projections(fused)
    unpacked = unpacked_copy(served).state_dict()  # the same values, in the plain layout
    assert unpacked.keys() == fused.state_dict().keys()
    assert all(torch.equal(tensor, unpacked[name]) for name, tensor in fused.state_dict().items())
    # a variant made from the served copy is the variant of the model as loaded
    assert torch.equal(in_precision(served, "int8")(tokens), in_precision(loaded, "int8")(tokens))
    onednn = unpacked_copy(served)
    pack_linears(onednn, pairs=False)  # every layer for oneDNN, as before the pairs
    assert not any(isinstance(m, PackedLinear) and m.paired for m in onednn.modules())
    assert all(torch.equal(onednn(tokens[i : i + 1])[0], onednn(tokens)[i]) for i in range(3))


@torch.inference_mode()
def test_a_float32_model_is_served_with_weights_transposed_where_that_is_faster_here() -> None:
    loaded = tiny_model(0)
    served = copy.deepcopy(loaded)
    serving_layout(served)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    layers = dict(served.named_modules())  # type: ignore[attr-defined]
    assert not any(isinstance(m, PackedLinear) for m in layers.values())
    linears = {name: m for name, m in layers.items() if isinstance(m, nn.Linear)}
    assert {"lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"} <= linears.keys()
    for name, linear in linears.items():  # what this CPU measured, for each shape
        transposed = transposed_is_faster(linear.in_features, linear.out_features)
        assert linear.weight.is_contiguous() != transposed, name
        assert linear.weight.shape == (linear.out_features, linear.in_features)
    assert layers["model.embed_tokens"].weight.is_contiguous()  # the embeddings stay as loaded
    tokens = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    logits, expected = served(tokens), loaded(tokens)
    assert torch.allclose(logits, expected, rtol=1e-4, atol=1e-4)  # MKL's sums, in another order
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    fused = copy.deepcopy(loaded)
    fuse_projections(fused)  # type: ignore[arg-type]  # a CausalLM is an nn.Module
    unpacked = unpacked_copy(served)  # type: ignore[arg-type]  # the same values, in the plain layout
    assert all(t.is_contiguous() for t in unpacked.state_dict().values())
    assert all(torch.equal(t, unpacked.state_dict()[n]) for n, t in fused.state_dict().items())  # type: ignore[attr-defined]
    # a variant made from the served copy is the variant of the model as loaded
    assert torch.equal(in_precision(served, "int8")(tokens), in_precision(loaded, "int8")(tokens))


def test_a_layout_is_timed_once_per_shape_and_leaves_torchs_random_state_as_it_was() -> None:
    # a worker's layers of one shape agree, and a seeded caller draws what it would have drawn
    transposed_is_faster.cache_clear()
    state = torch.get_rng_state()
    choice = transposed_is_faster(576, 1536)
    assert torch.equal(torch.get_rng_state(), state)
    assert transposed_is_faster(576, 1536) is choice
    assert transposed_is_faster.cache_info().misses == 1
    print(f"576->1536 float32 weights transposed on this CPU: {choice}")


@needs_bf16_products
@torch.inference_mode()
def test_smollm2_in_bfloat16_gives_a_decode_row_the_same_logits_alone_and_among_others(
    smollm2: Path, tmp_path: Path
) -> None:
    # two of SmolLM2's layers, real weights and shapes: on an AMD EPYC its 1536-wide down projection
    # rounds a row alone differently from the same row among others, unless padded
    directory = truncated_smollm2(smollm2, tmp_path, layers=2)
    model = load_directory(directory, "smollm2", "1", torch.device("cpu"), dtype=BFLOAT16).model
    rows = 64  # enough that a step's residual sums split between the threads (decoder_layers.cpp)
    tokens = torch.randint(0, model.vocab_size, (rows, 1), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(rows + 1)
    tables, positions = [[1 + i] for i in range(rows)], [[i % 16] for i in range(rows)]
    with torch.inference_mode():  # as a worker's forwards run: the served forward
        together = model(tokens, cache, cache.view(tables, positions, torch.device("cpu")))
        for i in range(rows):
            view = cache.view(tables[i : i + 1], positions[i : i + 1], torch.device("cpu"))
            assert torch.equal(model(tokens[i : i + 1], cache, view)[0], together[i]), f"row {i}"
