"""The built-in model: cached decoding matches the full pass; weights round-trip through safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.models import tiny_model
from workers.models.builtin import CONFIG_FILE, WEIGHTS_FILE, ModelConfig, Transformer


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
    loaded = Transformer.load(tmp_path)
    tokens = torch.tensor([[257, 49, 43, 50, 61]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def test_presets_and_config_validation() -> None:
    assert ModelConfig.from_name("arith-small").n_layers == 4
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.from_name("huge")
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "n_experts": 8})
