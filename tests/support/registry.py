"""Real MLflow registries in temp dirs: a SQLite tracking store and local artifacts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reflow.registry import Registry, VersionRef
from reflow.settings import Settings


def local_registry(root: Path, name: str = "mlflow") -> Registry:
    """A real MLflow store under `root`: a SQLite tracking database and local artifacts."""
    return Registry(f"sqlite:///{root / f'{name}.db'}", (root / f"{name}-artifacts").as_uri())


def settings_with_champion(
    root: Path, name: str, checkpoint: Path, tags: dict[str, str] | None = None, **overrides: Any
) -> Settings:
    """Settings of a data dir `root` whose registry holds `checkpoint` as `name` v1 @champion, for a
    fine-tune job on the CPU."""
    registry = local_registry(root)
    registry.register(name, checkpoint, params={}, metrics={}, alias="champion", tags=tags)
    return Settings(
        data_dir=root, mlflow_tracking_uri=registry.tracking_uri, model_name=name,
        mlflow_artifact_root=registry.artifact_root or "", device="cpu", **overrides,
    )  # fmt: skip


@dataclass(frozen=True)
class RegistryFixture:
    """A real MLflow store in a temp dir holding `arith` v1 (champion) and v2, both tiny."""

    tracking_uri: str
    artifact_root: str
    champion: VersionRef
    other: VersionRef

    def registry(self) -> Registry:
        return Registry(self.tracking_uri, self.artifact_root)
