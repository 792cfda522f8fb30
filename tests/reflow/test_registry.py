"""The MLflow registry against a real store: register, resolve aliases, download once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import save_model, tiny_model
from tests.support.registry import local_registry


def test_register_resolve_and_download(tmp_path: Path) -> None:
    registry = local_registry(tmp_path)
    assert not registry.has_alias("arith", "champion")
    directory = save_model(tiny_model(), tmp_path / "model")
    first = registry.register("arith", directory, params={"p": 1}, metrics={"m": 0.5}, alias="champion")
    second = registry.register("arith", directory, params={}, metrics={}, alias="challenger")
    assert (first.version, second.version) == ("1", "2")
    assert registry.resolve("arith", alias="champion").version == "1"
    assert registry.resolve("arith", version="2").aliases == ("challenger",)
    with pytest.raises(LookupError, match="no alias @nope"):
        registry.resolve("arith", alias="nope")
    local = registry.download(first, tmp_path / "cache")
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in directory.iterdir())
    (local / "config.json").write_text("{}")  # a cached copy is reused, not fetched again
    assert registry.download(first, tmp_path / "cache").joinpath("config.json").read_text() == "{}"


def test_refuses_to_register_without_every_file(tmp_path: Path) -> None:
    registry = local_registry(tmp_path)
    tiny_model().save(tmp_path / "model")  # no tokenizer.json
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        registry.register("arith", tmp_path / "model", params={}, metrics={}, alias="champion")
