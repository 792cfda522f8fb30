"""Real MLflow registries in temp dirs: a SQLite tracking store and local artifacts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from reflow.registry import Registry, VersionRef


def local_registry(root: Path, name: str = "mlflow") -> Registry:
    """A real MLflow store under `root`: a SQLite tracking database and local artifacts."""
    return Registry(f"sqlite:///{root / f'{name}.db'}", (root / f"{name}-artifacts").as_uri())


@dataclass(frozen=True)
class RegistryFixture:
    """A real MLflow store in a temp dir holding `arith` v1 (champion) and v2, both tiny."""

    tracking_uri: str
    artifact_root: str
    champion: VersionRef
    other: VersionRef

    def registry(self) -> Registry:
        return Registry(self.tracking_uri, self.artifact_root)
