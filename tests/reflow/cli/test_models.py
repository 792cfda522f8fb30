"""`reflow models list|promote|rollback` against a real MLflow registry, as an ML engineer uses them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from feedback.experiments.lifecycle import history, reconcile
from reflow.registry import Registry
from reflow.store.database import migrate, open_engine
from tests.support.cli import reflow
from tests.support.models import MODEL, save_model, tiny_model
from tests.support.registry import local_registry


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    """arith v1 @champion, v2 @challenger (from a fine-tune of v1), v3 without an alias."""
    registry = local_registry(tmp_path)
    for seed, alias, tags in ((0, "champion", {}), (1, "challenger", {"reflow.source": "finetune",
                              "reflow.parent_version": "1"}), (2, "staged", {})):  # fmt: skip
        directory = save_model(tiny_model(seed), tmp_path / f"v{seed}")
        registry.register(MODEL, directory, params={}, metrics={}, alias=alias, tags=tags)
    registry.delete_alias(MODEL, "staged")
    migrate(open_engine(f"sqlite:///{tmp_path / 'reflow.db'}"))
    return registry


def models(registry: Registry, *args: str) -> subprocess.CompletedProcess[str]:
    """`reflow models ARGS` on `registry`, with the store migrated beside it."""
    data_dir = Path(registry.tracking_uri.removeprefix("sqlite:///")).parent
    return reflow(
        "models",
        *args,
        env={"REFLOW_MLFLOW_TRACKING_URI": registry.tracking_uri, "REFLOW_DATA_DIR": str(data_dir)},
        timeout_s=120,
    )


def aliases(registry: Registry) -> dict[str, list[str]]:
    return {v["version"]: v["aliases"] for v in registry.versions(MODEL)}


def test_list_shows_versions_newest_first_with_aliases_and_origin(registry: Registry) -> None:
    listed = models(registry, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    versions = json.loads(listed.stdout)
    assert [(v["version"], v["aliases"]) for v in versions] == [
        ("3", []),
        ("2", ["challenger"]),
        ("1", ["champion"]),
    ]
    table = models(registry, "list").stdout.splitlines()
    assert table[1].split("\t")[:3] == ["2", "challenger", "finetune from v1"]
    assert models(registry, "list", "nosuch").returncode == 1


def test_promote_makes_the_challenger_champion_and_rollback_removes_a_challenger(
    registry: Registry, tmp_path: Path
) -> None:
    store = open_engine(f"sqlite:///{tmp_path / 'reflow.db'}")
    experiment = reconcile(store, registry, MODEL, 0.1)  # v2 under test
    assert experiment is not None
    promoted = models(registry, "promote", MODEL, "2")
    assert promoted.returncode == 0, promoted.stderr
    assert aliases(registry) == {"3": [], "2": ["champion"], "1": []}  # no longer the challenger
    assert history(store, experiment.id)[0].status == "ended"  # decided by hand
    assert models(registry, "rollback", MODEL).returncode == 1  # nothing to roll back
    registry.set_alias(MODEL, "challenger", "3")
    rolled_back = models(registry, "rollback", MODEL)
    assert rolled_back.returncode == 0 and aliases(registry) == {"3": [], "2": ["champion"], "1": []}
    missing = models(registry, "promote", MODEL, "9")
    assert missing.returncode == 1 and "no version 9" in missing.stderr
