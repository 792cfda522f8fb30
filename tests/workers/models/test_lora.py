"""LoRA adapters: the math (identity at zero B, merging, the base untouched with adapters off), rows
of several adapters in one forward, and PEFT's format both ways against transformers + peft."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.hf import VOCAB, random_adapter, tiny_checkpoint, transformers
from workers.models.greedy import greedy_answers
from workers.models.linears import PackedLinear
from workers.models.llama import LlamaForCausalLM, fuse_projections, serving_layout
from workers.models.loader import load_checkpoint
from workers.models.lora import ADAPTER_CONFIG_FILE, Adapter, AdapterSet, LoraConfig

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def peft() -> Any:
    return pytest.importorskip("peft", reason="the reference for adapters: pip install -e '.[test]'")


def tokens(rows: int, length: int = 12, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_an_adapter_with_zero_b_is_the_identity(checkpoint: Path) -> None:
    model, _ = load_checkpoint(checkpoint)
    assert isinstance(model, LlamaForCausalLM)
    adapter = Adapter.new(model, LoraConfig(rank=4))
    batch = tokens(3)
    assert torch.equal(model(batch, adapters=adapter.rows(3)), model(batch))


@torch.inference_mode()
def test_merged_weights_give_the_logits_of_base_plus_adapter(checkpoint: Path) -> None:
    model, _ = load_checkpoint(checkpoint)
    assert isinstance(model, LlamaForCausalLM)
    adapter = random_adapter(
        model, LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")), seed=1
    )
    batch = tokens(2)
    base = model(batch)
    adapted = model(batch, adapters=adapter.rows(2))
    assert (adapted - base).abs().max() > 0.1  # the adapter matters
    adapter.merge_into(model)
    torch.testing.assert_close(model(batch), adapted, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_rows_of_two_adapters_and_of_none_in_one_forward_each_get_their_own_logits(checkpoint: Path) -> None:
    model, _ = load_checkpoint(checkpoint)
    assert isinstance(model, LlamaForCausalLM)
    first = random_adapter(model, LoraConfig(rank=4), seed=1)
    second = random_adapter(model, LoraConfig(rank=2, alpha=4, targets=("k_proj", "up_proj")), seed=2)
    served = AdapterSet([first.to(CPU, model.dtype), second.to(CPU, model.dtype)])
    batch = tokens(3)
    alone = [
        model(batch[:1]),
        model(batch[1:2], adapters=first.rows(1)),
        model(batch[2:], adapters=second.rows(1)),
    ]
    mixed = model(batch, adapters=served.rows([None, 0, 1]))
    for row, expected in enumerate(alone):
        torch.testing.assert_close(mixed[row : row + 1], expected, rtol=1e-5, atol=1e-5)
    assert served.rows([None, None, None]) is None  # base rows alone run the base model untouched
    served.remove(0)
    torch.testing.assert_close(model(batch[2:], adapters=served.rows([0])), alone[2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@torch.inference_mode()
def test_a_model_fused_for_serving_gives_each_row_the_logits_of_the_model_as_loaded_with_its_adapter(
    checkpoint: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    # q/k/v and gate/up in one product each: every output channel is the same product, and each
    # part gets its own adapter's update by its name, as the separate layers do
    model, _ = load_checkpoint(checkpoint, dtype=dtype)
    fused = copy.deepcopy(model)
    fuse_projections(fused)  # type: ignore[arg-type]  # an nn.Module
    assert not hasattr(fused.model.layers[0].self_attn, "q_proj")  # type: ignore[attr-defined]
    first = random_adapter(fused, LoraConfig(rank=4), seed=1)  # type: ignore[arg-type]  # made on the fused one
    second = random_adapter(model, LoraConfig(rank=2, alpha=4, targets=("k_proj", "up_proj")), seed=2)  # type: ignore[arg-type]
    served = AdapterSet([first.to(CPU, dtype), second.to(CPU, dtype)])
    rows = served.rows([None, 0, 1])
    batch = tokens(3)
    assert torch.equal(fused(batch, adapters=rows), model(batch, adapters=rows))
    assert (model(batch, adapters=rows) - model(batch)).abs().max() > 0.01  # the adapters matter
    second.check(fused)  # type: ignore[arg-type]
    first.weights["model.layers.1.self_attn.v_proj"] = (torch.zeros(4, 64), torch.zeros(63, 4))
    with pytest.raises(ValueError, match="v_proj is 63x64; the base model's is 32x64"):
        first.check(fused)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fused for serving is not saved"):
        fused.save(tmp_path / "fused")
    with pytest.raises(ValueError, match="stacked with others for serving"):
        second.merge_into(fused)  # type: ignore[arg-type]


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bfloat16 products on this CPU"
)
@torch.inference_mode()
def test_a_model_packed_for_serving_adapts_each_row_as_the_model_as_loaded(checkpoint: Path) -> None:
    model, _ = load_checkpoint(checkpoint, dtype=torch.bfloat16)
    packed = copy.deepcopy(model)
    serving_layout(packed)  # type: ignore[arg-type]  # an nn.Module
    assert isinstance(dict(packed.named_modules())["model.layers.0.mlp.gate_up_proj"], PackedLinear)  # type: ignore[attr-defined]
    adapter = random_adapter(model, LoraConfig(rank=4), seed=1)  # type: ignore[arg-type]
    adapter.check(packed)  # type: ignore[arg-type]  # each part of a packed stack by its own name
    rows = AdapterSet([adapter.to(CPU, torch.bfloat16)]).rows([None, 0])
    batch = tokens(2)
    adapted, expected = packed(batch, adapters=rows).float(), model(batch, adapters=rows).float()
    assert ((adapted - expected).norm() / expected.norm()).item() < 0.02  # bfloat16's rounding
    assert ((adapted - packed(batch).float())[1].abs().max()) > 0.1  # the adapter matters
    with pytest.raises(ValueError, match="packed for serving is not trained"):
        Adapter.new(packed, LoraConfig(rank=4))  # type: ignore[arg-type]


def test_the_base_weights_are_untouched_by_training_an_adapter(checkpoint: Path) -> None:
    model, _ = load_checkpoint(checkpoint)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = Adapter.new(model, LoraConfig(rank=4), seed=0)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    batch = tokens(2)
    for _ in range(3):
        loss = model(batch, adapters=adapter.rows(2)).logsumexp(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        assert not torch.equal(model(batch, adapters=adapter.rows(2)), model(batch))  # it learned
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the reference is the base


def test_peft_config_values_reflow_cannot_apply_are_refused() -> None:
    base = LoraConfig(rank=4).to_peft("tiny")
    assert LoraConfig.from_peft(base) == LoraConfig(
        rank=4, alpha=16.0, targets=tuple(sorted(base["target_modules"]))
    )
    for key, value in (
        ("use_dora", True),
        ("bias", "all"),
        ("peft_type", "IA3"),
        ("target_modules", ".*proj"),
    ):
        with pytest.raises(ValueError, match=key if key != "target_modules" else "list of module names"):
            LoraConfig.from_peft({**base, key: value})


@torch.inference_mode()
def test_an_adapter_peft_saved_gives_the_logits_and_greedy_text_of_transformers_plus_peft(
    checkpoint: Path, tmp_path: Path
) -> None:
    library = peft()
    reference = transformers().AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = library.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "gate_proj"], lora_dropout=0.0
    )
    wrapped = library.get_peft_model(reference, config)
    torch.manual_seed(5)
    for name, parameter in wrapped.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_(0, 0.3)
    wrapped.eval().save_pretrained(tmp_path / "adapter")
    model, tokenizer = load_checkpoint(checkpoint)
    adapter = Adapter.load(tmp_path / "adapter", CPU, torch.float32)
    adapter.check(model)
    batch = tokens(2)
    torch.testing.assert_close(
        model(batch, adapters=adapter.rows(2)), wrapped(input_ids=batch).logits, rtol=1e-4, atol=1e-4
    )
    prompt = " ".join(f"w{i}" for i in (5, 9, 17, 33))
    ids = torch.tensor([tokenizer.encode(prompt)])
    expected = wrapped.generate(input_ids=ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    merged, _ = load_checkpoint(checkpoint)
    adapter.merge_into(merged)  # greedy_answers runs the model as it is: the adapter merged in
    [text] = greedy_answers(merged, tokenizer, [prompt], max_new_tokens=16)
    assert text == tokenizer.decode(expected[0, ids.shape[1] :].tolist())


@torch.inference_mode()
def test_an_adapter_reflow_saved_loads_in_peft_with_the_same_logits(checkpoint: Path, tmp_path: Path) -> None:
    library = peft()
    model, _ = load_checkpoint(checkpoint)
    assert isinstance(model, LlamaForCausalLM)
    adapter = random_adapter(model, LoraConfig(rank=4, alpha=8), seed=7)
    adapter.save(tmp_path / "adapter", base_model=str(checkpoint))
    assert (tmp_path / "adapter" / ADAPTER_CONFIG_FILE).is_file()
    reference = transformers().AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    wrapped = library.PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    batch = tokens(2)
    torch.testing.assert_close(
        wrapped(input_ids=batch).logits, model(batch, adapters=adapter.rows(2)), rtol=1e-4, atol=1e-4
    )
