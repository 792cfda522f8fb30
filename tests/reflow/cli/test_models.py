"""`reflow models import|list|promote|rollback` against a real MLflow registry, as ML engineers use them."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from feedback.experiments.lifecycle import history, reconcile
from reflow.registry import Registry
from reflow.store.database import migrate, open_db
from tests.support.cli import reflow
from tests.support.hf import tiny_checkpoint, transformers
from tests.support.models import MODEL, save_model, tiny_model
from tests.support.registry import local_registry
from workers.models.loader import load_checkpoint

pytestmark = pytest.mark.slow  # a `reflow` process per command, each loading MLflow


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    """arith v1 @champion, v2 @challenger (from a fine-tune of v1), v3 without an alias."""
    registry = local_registry(tmp_path)
    for seed, alias, tags in ((0, "champion", {}), (1, "challenger", {"reflow.source": "finetune",
                              "reflow.parent_version": "1"}), (2, "staged", {})):  # fmt: skip
        directory = save_model(tiny_model(seed), tmp_path / f"v{seed}")
        registry.register(MODEL, directory, params={}, metrics={}, alias=alias, tags=tags)
    registry.delete_alias(MODEL, "staged")
    migrate(open_db(f"sqlite:///{tmp_path / 'reflow.db'}"))
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
    store = open_db(f"sqlite:///{tmp_path / 'reflow.db'}")
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


def importing(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`reflow models import ARGS` into the registry of `data_dir` (made on first use)."""
    env = {"REFLOW_DATA_DIR": str(data_dir), "COLUMNS": "1000"}  # errors on one line, unwrapped
    return reflow("models", "import", *args, env=env, timeout_s=120)


def test_a_hugging_face_checkpoint_imports_once_and_serves_as_transformers_wrote_it(tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint(tmp_path / "tiny-llama", tie_word_embeddings=True)
    data_dir = tmp_path / "data"
    first = importing(data_dir, str(checkpoint), "--name", "tiny")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "tiny@champion -> version 1"
    again = importing(data_dir, str(checkpoint), "--name", "tiny", "--alias", "challenger")
    assert again.returncode == 0, again.stderr
    assert "is already tiny version 1; nothing imported" in again.stdout
    registry = Registry(f"sqlite:///{data_dir / 'mlflow.db'}")
    [version] = registry.versions("tiny")
    assert (version["aliases"], version["tags"]["reflow.source"]) == (["champion"], "import")
    files = registry.download(registry.resolve("tiny", alias="champion"), tmp_path / "cache")
    assert sorted(p.name for p in files.iterdir()) == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    model, _ = load_checkpoint(files)
    with torch.inference_mode():
        ids = torch.tensor([[5, 17, 33, 2]])
        expected = transformers().AutoModelForCausalLM.from_pretrained(checkpoint).eval()(ids).logits
        torch.testing.assert_close(model(ids), expected, rtol=0, atol=1e-5)


def test_pickles_and_unknown_architectures_are_refused_with_what_to_do(tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (pickled / "pytorch_model.bin").write_bytes(b"not even read")
    refused = importing(tmp_path / "data", str(pickled), "--name", "p")
    assert refused.returncode == 1
    assert "holds pickled weights (pytorch_model.bin); reflow never unpickles" in refused.stderr
    single = tmp_path / "model.pt"
    single.write_bytes(b"not even read")
    assert "model.pt holds pickled weights" in importing(tmp_path / "data", str(single), "--name", "p").stderr
    unknown = tiny_checkpoint(tmp_path / "mamba")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    refused = importing(tmp_path / "data", str(unknown), "--name", "m")
    assert refused.returncode == 1
    assert "holds a 'mamba' model; reflow implements llama, mistral, qwen2, qwen3, reflow" in refused.stderr
    assert (
        not (tmp_path / "data" / "mlflow.db").exists()
        or not Registry(f"sqlite:///{tmp_path / 'data' / 'mlflow.db'}").client.search_registered_models()
    )  # nothing was registered


def test_a_hugging_face_cache_snapshot_imports_through_its_links_into_blobs(tmp_path: Path) -> None:
    written = tiny_checkpoint(tmp_path / "written")
    repository = tmp_path / "hub" / "models--org--tiny-llama"  # huggingface_hub's cache layout
    blobs, snapshot = repository / "blobs", repository / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(written.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(blobs / blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    imported = importing(tmp_path / "data", str(snapshot), "--name", "tiny")
    assert imported.returncode == 0, imported.stderr
    registry = Registry(f"sqlite:///{tmp_path / 'data' / 'mlflow.db'}")
    files = registry.download(registry.resolve("tiny", alias="champion"), tmp_path / "cache")
    assert sorted(p.name for p in files.iterdir()) == sorted(p.name for p in snapshot.iterdir())


def test_links_out_of_a_checkpoint_and_broken_files_are_refused_in_one_line(tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    leaky = tiny_checkpoint(tmp_path / "leaky")
    (leaky / "chat_template.jinja").symlink_to(key)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 1))  # a tensor and a key promised, then nothing
    # a directory and a GGUF file: each refusal's message is tested in tests/workers/models/test_importing.py
    for path, message in [
        (leaky, f"chat_template.jinja links to {key}, outside the checkpoint {leaky}"),
        (truncated, "truncated.gguf is a damaged GGUF file (truncated or corrupt"),
    ]:
        refused = importing(tmp_path / "data", str(path), "--name", "refused")
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        [error] = [line for line in lines if not line.startswith("20")]  # MLflow's log lines aside
        assert error.startswith("error: ") and message in error, error
    registry = Registry(f"sqlite:///{tmp_path / 'data' / 'mlflow.db'}")
    assert not registry.client.search_registered_models()  # nothing was registered


def test_a_tenant_says_what_its_feedback_trains_and_is_served_its_own_champion(registry: Registry) -> None:
    """`reflow tenants create|update|show|list` and `reflow models promote --tenant`: a new tenant
    trains its own versions and is served the shared champion until it has one of its own."""

    def tenants(*args: str) -> subprocess.CompletedProcess[str]:
        data_dir = Path(registry.tracking_uri.removeprefix("sqlite:///")).parent
        env = {"REFLOW_MLFLOW_TRACKING_URI": registry.tracking_uri, "REFLOW_DATA_DIR": str(data_dir)}
        return reflow("tenants", *args, env=env, timeout_s=120)

    def shown() -> dict[str, object]:
        result = tenants("show", "acme", "--json")
        assert result.returncode == 0, result.stderr
        return dict(json.loads(result.stdout))

    created = tenants("create", "acme")
    assert created.returncode == 0 and "pinned to arith v1" in created.stderr, created.stderr
    assert {k: shown()[k] for k in ("trains", "served_version", "served_champion", "experiment")} == {
        "trains": "own", "served_version": "1", "served_champion": "pinned", "experiment": None,
    }  # fmt: skip
    promoted = models(registry, "promote", MODEL, "3", "--tenant", "acme")
    assert promoted.returncode == 0, promoted.stderr
    assert promoted.stdout.startswith(f"{MODEL}@tenant-1-champion -> version 3")
    assert (shown()["served_version"], shown()["served_champion"]) == ("3", "pinned")
    assert registry.resolve(MODEL, alias="champion").version == "1"  # the shared champion stays
    registry.client.set_model_version_tag(MODEL, "2", "reflow.tenant", "globex")
    refused = models(registry, "promote", MODEL, "2", "--tenant", "acme")  # another tenant's own
    assert refused.returncode == 1 and "tenant globex's own" in refused.stderr

    updated = tenants("update", "acme", "--trains", "nothing", "--rpm", "7")
    assert updated.returncode == 0, updated.stderr
    assert "trains nothing" in updated.stdout and "7 rpm" in updated.stdout
    assert "trains nothing" in tenants("list").stdout
    assert tenants("update", "acme", "--trains", "shared").returncode == 0  # its own aliases go
    assert (shown()["served_version"], shown()["served_champion"]) == ("1", "the shared model's")
    missing = tenants("update", "ghost", "--trains", "own")
    assert missing.returncode == 1 and "no tenant named 'ghost'" in missing.stderr
    wrong = tenants("create", "bad", "--trains", "everything")
    assert wrong.returncode == 2 and "everything" in wrong.stderr
