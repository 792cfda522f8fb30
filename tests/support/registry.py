"""Real MLflow registries in temp dirs: a SQLite tracking store and local artifacts.

A new store starts as a copy of an empty one at MLflow's current schema: MLflow migrates a new
SQLite store through its ~50 Alembic revisions, about 4 s of CPU, and the suite makes dozens.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from reflow.registry import Registry, VersionRef
from reflow.settings import Settings


@functools.cache
def empty_store() -> Path:
    """An empty MLflow SQLite store, made once per MLflow version on this machine (its schema is all
    that is in it) and shared by every test process."""
    import mlflow

    shelf = Path(tempfile.gettempdir()) / "reflow-tests"
    shelf.mkdir(exist_ok=True)
    store = shelf / f"empty-mlflow-{mlflow.__version__}.db"
    with FileLock(shelf / f"{store.name}.lock"):
        if not store.is_file():
            making = shelf / f"{store.name}.new"
            making.unlink(missing_ok=True)
            Registry(f"sqlite:///{making}").client.search_registered_models()  # migrates it
            making.rename(store)
    return store


def new_store(database: Path) -> Path:
    """Puts an empty MLflow store at `database` (a SQLite file), unless one is there."""
    if not database.exists():
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(empty_store(), database)
    return database


def local_registry(root: Path, name: str = "mlflow") -> Registry:
    """A real MLflow store under `root`: a SQLite tracking database and local artifacts."""
    return Registry(f"sqlite:///{new_store(root / f'{name}.db')}", (root / f"{name}-artifacts").as_uri())


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
