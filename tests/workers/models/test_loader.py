"""The loader picks a checkpoint's implementation from its files, and refuses what it does not implement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.models import save_model, tiny_model
from workers.models.loader import load_checkpoint, resolve_device


def test_a_saved_built_in_model_loads_as_itself(tmp_path: Path) -> None:
    model = tiny_model(4)
    save_model(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "reflow"
    loaded, tokenizer = load_checkpoint(tmp_path)
    ids = torch.tensor([tokenizer.encode("47+38=")])
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)
    assert (loaded.vocab_size, loaded.max_seq_len, tokenizer.reasoning_markers) == (272, 64, (259, 260))


def test_a_config_from_before_model_type_still_loads(tmp_path: Path) -> None:
    save_model(tiny_model(4), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["model_type"]  # as versions registered before the seam wrote it
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_checkpoint(tmp_path)
    assert loaded.max_seq_len == 64


def test_what_reflow_does_not_implement_is_refused_with_what_it_does(tmp_path: Path) -> None:
    save_model(tiny_model(4), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(ValueError, match=r"holds a 'mamba' model; reflow implements llama, mistral, qwen2"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    with pytest.raises(ValueError, match="not a tokenizer reflow can read: Missing vocab"):
        load_checkpoint(tmp_path)


def test_devices() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            resolve_device("cuda:0")
