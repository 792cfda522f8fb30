"""The MLflow model registry: register versions, resolve aliases, fetch a version's files."""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reflow.private_files import private_dir

if TYPE_CHECKING:
    from reflow.settings import Settings

logger = logging.getLogger(__name__)

EXPERIMENT_NAME = "reflow"
CHAMPION, CHALLENGER = "champion", "challenger"  # the aliases an A/B experiment tests
# A tenant whose feedback trains its own versions (`tenants.trains`) has the two of its own, by its
# id (alias names allow only letters, digits, "_" and "-"); one it is pinned to is its champion too.
TENANT_ALIAS = re.compile(r"tenant-(\d+)-(champion|challenger)")


def tenant_alias(tenant_id: int, arm: str) -> str:
    """The alias of tenant `tenant_id`'s `arm` (CHAMPION or CHALLENGER)."""
    return f"tenant-{tenant_id}-{arm}"


MODEL_ARTIFACT_PATH = "model"
# What every version carries; beside them it may carry more of the same kinds (weight shards and
# their index, the tokenizer's config, a chat template, generation defaults).
REQUIRED_FILES = ("config.json", "tokenizer.json")
# What a LoRA adapter version carries instead: PEFT's files (workers/models/lora.py), served over
# the weights of the version its BASE_VERSION_TAG names.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
BASE_VERSION_TAG = "reflow.base_version"
# The only kinds of file a version may carry: safetensors weights, JSON, a Jinja chat template.
# Never a pickle.
VERSION_FILE_SUFFIXES = (".safetensors", ".json", ".jinja")
# A version's greedy accuracy on its task (the fine-tune job's and the bootstrap's, on a fixed set
# of live traffic's prompts), and with ".<variant>" each variant's (REFLOW_VARIANTS) as built from
# it: what workers report beside a variant's agreements. Absent for a version without a task.
TASK_SCORE_TAG = "reflow.task_score"
SOURCE_TAG = "reflow.source"  # where a version came from: "bootstrap", "finetune", IMPORTED
IMPORTED = "import"  # a checkpoint brought in by `reflow models import`
TENANT_TAG = "reflow.tenant"  # on a tenant's own versions: its name; no other tenant is served them
SOURCE_SHA256_TAG = "reflow.source_sha256"  # on imported versions: the digest of the files imported


def version_files(model_dir: Path) -> list[Path]:
    """The files of `model_dir` a version carries; FileNotFoundError naming what is missing."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in VERSION_FILE_SUFFIXES)
    names = {p.name for p in files}
    required = ADAPTER_FILES if ADAPTER_FILES[0] in names else REQUIRED_FILES
    missing = [f for f in required if f not in names]
    if missing or not any(p.suffix == ".safetensors" for p in files):
        raise FileNotFoundError(f"{model_dir} lacks {missing or ['*.safetensors weights']}")
    return files


@dataclass(frozen=True)
class VersionRef:
    """One registered model version and the aliases that point at it."""

    name: str
    version: str
    aliases: tuple[str, ...] = ()


class Registry:
    """A thin, typed face on MlflowClient for the operations reflow needs."""

    def __init__(self, tracking_uri: str, artifact_root: str | None = None):
        from mlflow.tracking import MlflowClient  # slow import: only for processes that need it

        self.tracking_uri = tracking_uri
        self.artifact_root = artifact_root
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)

    @classmethod
    def from_settings(cls, settings: Settings) -> Registry:
        """The registry REFLOW_MLFLOW_TRACKING_URI (and artifact root) name; the embedded one's data
        dir is created private, before MLflow would create it readable by all."""
        if not settings.mlflow_tracking_uri:
            private_dir(settings.data_dir)
        return cls(settings.resolved_tracking_uri, settings.resolved_artifact_root)

    def resolve(self, name: str, *, version: str = "", alias: str = "") -> VersionRef:
        """The version asked for by number, else by alias; LookupError when there is none."""
        from mlflow.exceptions import MlflowException

        try:
            if version:
                mv = self.client.get_model_version(name, version)
            else:
                mv = self.client.get_model_version_by_alias(name, alias)
        except MlflowException as error:
            what = f"version {version}" if version else f"alias @{alias}"
            raise LookupError(f"model {name!r} has no {what} in the registry") from error
        return VersionRef(name, str(mv.version), tuple(mv.aliases))

    def has_alias(self, name: str, alias: str) -> bool:
        """True when `name@alias` resolves."""
        try:
            self.resolve(name, alias=alias)
        except LookupError:
            return False
        return True

    def aliases(self, name: str) -> dict[str, str]:
        """Every alias of `name` and the version it points at, read in one call (a consistent
        snapshot); empty when `name` is not registered."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_registered_model(name).aliases
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return {}
            raise  # an outage: the caller keeps what it had rather than read "no aliases"
        return {alias: str(version) for alias, version in found.items()}

    def versions(self, name: str) -> list[dict[str, object]]:
        """Every version of `name`, newest first: version, aliases, run id, creation time, tags."""
        from mlflow.exceptions import MlflowException

        try:
            aliases_of: dict[str, list[str]] = {}
            for alias, version in self.client.get_registered_model(name).aliases.items():
                aliases_of.setdefault(str(version), []).append(alias)
        except MlflowException as error:
            raise LookupError(f"no registered model named {name!r}") from error
        found = self.client.search_model_versions(f"name='{name}'")
        return [
            {
                "version": str(mv.version), "aliases": sorted(aliases_of.get(str(mv.version), [])),
                "run_id": mv.run_id or "", "created_ms": mv.creation_timestamp, "tags": dict(mv.tags),
            }
            for mv in sorted(found, key=lambda mv: int(mv.version), reverse=True)
        ]  # fmt: skip

    def tags(self, ref: VersionRef) -> dict[str, str]:
        """The tags of one version (`reflow.source`, `reflow.parent_version`, ...)."""
        return dict(self.client.get_model_version(ref.name, ref.version).tags)

    def find_version(self, name: str, tag: str, value: str) -> str | None:
        """The version of `name` tagged `tag=value`, or None (also when `name` is not registered)."""
        found = self.client.search_model_versions(f"name='{name}' and tags.`{tag}` = '{value}'")
        return str(found[0].version) if found else None

    def set_alias(self, name: str, alias: str, version: str) -> None:
        """Points `name@alias` at `version` (which must exist); workers following it swap to it."""
        self.resolve(name, version=version)
        self.client.set_registered_model_alias(name, alias, version)
        logger.info("alias model=%s @%s -> version %s", name, alias, version)

    def delete_alias(self, name: str, alias: str) -> bool:
        """Removes `name@alias`; False when it did not exist."""
        if not self.has_alias(name, alias):
            return False
        self.client.delete_registered_model_alias(name, alias)  # a no-op if removed meanwhile
        logger.info("alias model=%s @%s removed", name, alias)
        return True

    def download(self, ref: VersionRef, cache_dir: Path) -> Path:
        """A local directory holding the version's files, downloaded once and then reused.

        The cache is keyed by the version's run, so a registry rebuilt from scratch never
        serves stale files; concurrent downloads of one version are safe (first rename wins).
        """
        import mlflow.artifacts

        mv = self.client.get_model_version(ref.name, ref.version)
        target = cache_dir / ref.name / f"{ref.version}-{mv.run_id or 'norun'}"
        if target.is_dir():  # renamed into place only once complete
            return target
        if not mv.source:
            raise LookupError(f"model {ref.name!r} version {ref.version} has no artifacts in the registry")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            staging = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=mv.source, dst_path=tmp, tracking_uri=self.tracking_uri
                )
            )
            version_files(staging)  # every version has its config, tokenizer and weights
            try:
                staging.rename(target)
            except OSError:  # another process got there first: its copy is complete
                if not target.is_dir():
                    raise
        logger.info("downloaded model=%s version=%s to %s", ref.name, ref.version, target)
        return target

    def experiment_id(self) -> str:
        """The `reflow` experiment, created with the configured artifact root when missing."""
        experiment = self.client.get_experiment_by_name(EXPERIMENT_NAME)
        if experiment is not None:
            return experiment.experiment_id
        return self.client.create_experiment(EXPERIMENT_NAME, artifact_location=self.artifact_root)

    def log_run(
        self,
        run_name: str,
        *,
        params: dict[str, object],
        metrics: dict[str, float],
        model_dir: Path | None = None,
        history: dict[str, list[float]] | None = None,
        tags: dict[str, str] | None = None,
    ) -> tuple[str, str]:
        """Logs a finished run: params, metrics, per-step `history` curves and the model's files
        (when given) under `model/`; returns (run_id, the model's artifact URI)."""
        from mlflow.entities import Metric, Param, RunTag

        files = version_files(model_dir) if model_dir is not None else []
        run = self.client.create_run(self.experiment_id(), run_name=run_name)
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        logged = [Metric(key, value, now, 0) for key, value in metrics.items()]
        for key, values in (history or {}).items():
            logged += [Metric(key, value, now, step) for step, value in enumerate(values, start=1)]
        batch = 1000  # MLflow takes at most 1000 metrics per call
        for start in range(0, max(len(logged), 1), batch):
            self.client.log_batch(
                run_id,
                metrics=logged[start : start + batch],
                params=[Param(key, str(value)) for key, value in params.items()] if start == 0 else [],
                tags=[RunTag(key, value) for key, value in (tags or {}).items()] if start == 0 else [],
            )
        for path in files:
            self.client.log_artifact(run_id, str(path), MODEL_ARTIFACT_PATH)
        self.client.set_terminated(run_id)
        return run_id, f"{run.info.artifact_uri}/{MODEL_ARTIFACT_PATH}"

    def register_version(
        self, name: str, run_id: str, source: str, *, alias: str, tags: dict[str, str] | None = None
    ) -> VersionRef:
        """Registers the model a run logged as a new version of `name` and points `alias` at it
        (none when `alias` is empty)."""
        from mlflow.exceptions import MlflowException

        with contextlib.suppress(MlflowException):  # already registered
            self.client.create_registered_model(name)
        mv = self.client.create_model_version(name, source, run_id=run_id, tags=tags or {})
        if alias:
            self.client.set_registered_model_alias(name, alias, mv.version)
        logger.info("registered model=%s version=%s alias=%s", name, mv.version, alias or "-")
        return VersionRef(name, str(mv.version), (alias,) if alias else ())

    def register(
        self,
        name: str,
        model_dir: Path,
        *,
        params: dict[str, object],
        metrics: dict[str, float],
        alias: str,
        tags: dict[str, str] | None = None,
    ) -> VersionRef:
        """Logs a run holding `model_dir`, registers it as a new version and points `alias` at it."""
        run_id, source = self.log_run(f"{name}-register", params=params, metrics=metrics, model_dir=model_dir)
        return self.register_version(name, run_id, source, alias=alias, tags=tags)
