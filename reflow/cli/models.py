"""`reflow models`: checkpoints imported as versions, registered versions and their aliases, moved
by hand."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, cast

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from reflow.cli.common import current_db, err_console, fail, load_settings, open_registry
from reflow.private_files import private_dir
from reflow.registry import IMPORTED, SOURCE_SHA256_TAG, SOURCE_TAG
from reflow.scopes import SHARED, Scope, scope_named, unshared_tenant_ids
from reflow.settings import Settings

app = typer.Typer(help="Registered model versions and their aliases.", no_args_is_help=True)


@app.command("import")
def models_import(
    path: Annotated[Path, typer.Argument(help="A Hugging Face checkpoint directory or a .gguf file.")],
    name: Annotated[str, typer.Option(help="Registered model to add the version to.")],
    alias: Annotated[str, typer.Option(help="Alias to point at the new version.")] = "champion",
) -> None:
    """Register a checkpoint as the next version of NAME (safetensors or GGUF; never pickles)."""
    settings = load_settings()
    version, new = import_checkpoint(settings, path, name, alias)
    if new:
        print(f"{name}@{alias} -> version {version}")
    else:
        print(f"{path} is already {name} version {version}; nothing imported")


def import_checkpoint(settings: Settings, path: Path, name: str, alias: str) -> tuple[str, bool]:
    """Imports `path` as a version of `name` at `alias`, with a progress bar; returns the version
    and whether it is new (the same files import once). Ends the command on a refused checkpoint."""
    from workers.models import importing  # torch: 1.3 s off `reflow --help`

    registry = open_registry(settings)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    try:
        files = importing.source_files(path)
        with Progress(*columns, console=err_console, transient=True) as progress:
            task = progress.add_task(f"importing {path.name}", total=importing.total_bytes(files))

            def advance(n: int) -> None:
                progress.advance(task, n)

            digest = importing.fingerprint(files, advance)
            if (present := registry.find_version(name, SOURCE_SHA256_TAG, digest)) is not None:
                return present, False
            private_dir(settings.data_dir)
            with tempfile.TemporaryDirectory(dir=settings.data_dir) as tmp:
                directory = importing.prepare(files, Path(tmp) / "checkpoint", advance)
                ref = registry.register(
                    name, directory, params={"source": path.name}, metrics={}, alias=alias,
                    tags={SOURCE_TAG: IMPORTED, SOURCE_SHA256_TAG: digest},
                )  # fmt: skip
    except ValueError as error:
        fail(error)
    return ref.version, True


def name_of(path: Path) -> str:
    """A registered model name for a checkpoint path: its file or directory name, lowercased, with
    what MLflow names should not hold turned into dashes (`SmolLM2-135M.Q4_1.gguf` -> `smollm2-135m-q4_1`)."""
    stem = path.name.removesuffix(".gguf") if path.is_file() else path.resolve().name
    return re.sub(r"[^a-z0-9_-]+", "-", stem.lower()).strip("-") or "model"


@app.command("list")
def models_list(
    name: Annotated[str | None, typer.Argument(help="Registered model [default: REFLOW_MODEL_NAME].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """Versions of a registered model, newest first, with their aliases and where they came from."""
    settings = load_settings()
    try:
        versions = open_registry(settings).versions(name or settings.model_name)
    except LookupError as error:
        fail(f"{error}")
    if as_json:
        print(json.dumps(versions))
        return
    for v in versions:
        tags, aliases = cast("dict[str, str]", v["tags"]), cast("list[str]", v["aliases"])
        origin = tags.get("reflow.source", "") + (
            f" from v{tags['reflow.parent_version']}" if "reflow.parent_version" in tags else ""
        )
        print(f"{v['version']}\t{','.join(aliases) or '-'}\t{origin or '-'}\t{v['run_id'] or '-'}")


def _follow_aliases(settings: Settings, registry: Any, name: str, scope: Scope = SHARED) -> None:
    """After a move by hand: ends the experiment on the old aliases (opening one when a challenger
    remains) and tells the running workers to follow now; they poll anyway."""
    # numpy, alembic, grpc: 280 ms off `reflow --help`
    from feedback.experiments.lifecycle import reconcile
    from feedback.experiments.promotion import push_to_workers
    from reflow.store.database import open_db, require_current_schema
    from reflow.worker_calls import WorkerTargets

    db = open_db(settings.resolved_database_url)
    try:
        require_current_schema(db)
        reconcile(db, registry, name, settings.ab_traffic, scope)
    except Exception as error:  # the aliases moved all the same; the scheduler catches up
        err_console.print(
            f"[yellow]experiments not updated ({error}); the scheduler's next evaluation will[/]"
        )
    finally:
        db.dispose()

    pushed = push_to_workers(WorkerTargets.from_settings(settings))
    failed = {a: why for a, why in pushed.items() if why != "ok"}
    for address, why in failed.items():
        err_console.print(f"[yellow]worker {address} did not answer ({why}); it follows within "
                          f"REFLOW_REGISTRY_POLL_S={settings.registry_poll_s:g}s[/]")  # fmt: skip
    if pushed and not failed:
        print(f"{len(pushed)} worker(s) now follow it")


@app.command("promote")
def models_promote(
    name: str,
    version: str,
    tenant: Annotated[str, typer.Option(help="Make it this tenant's own champion instead.")] = "",
) -> None:
    """Make VERSION the champion (no longer the challenger; a LoRA adapter is merged into its base
    as a new version first), or with --tenant that tenant's own champion; the workers follow at
    once. Tenants that did not opt into the shared model stay on the version they were served."""
    from feedback.experiments.promotion import promote  # grpc: 45 ms off `reflow --help`

    settings = load_settings()
    registry = open_registry(settings)
    db = current_db(settings)
    try:
        scope = scope_named(db, tenant)
        unshared = unshared_tenant_ids(db) if not tenant else []
        champion = promote(registry, name, version, settings.model_cache_dir, scope, unshared)
    except LookupError as error:
        fail(f"{error}")
    merged = f" (adapter v{version} merged into it)" if champion != version else ""
    print(f"{name}@{scope.champion} -> version {champion}{merged}")
    _follow_aliases(settings, registry, name, scope)


@app.command("rollback")
def models_rollback(
    name: str,
    tenant: Annotated[str, typer.Option(help="Remove this tenant's own challenger instead.")] = "",
) -> None:
    """Remove the challenger alias (or with --tenant that tenant's own): workers stop serving it,
    the champion keeps all traffic."""
    from feedback.experiments.promotion import roll_back  # grpc: 45 ms off `reflow --help`

    settings = load_settings()
    registry = open_registry(settings)
    try:
        scope = scope_named(current_db(settings), tenant)
    except LookupError as error:
        fail(f"{error}")
    if not roll_back(registry, name, scope=scope):
        fail(f"{name} has no challenger of {scope} to roll back")
    print(f"{name}@{scope.challenger} removed")
    _follow_aliases(settings, registry, name, scope)
