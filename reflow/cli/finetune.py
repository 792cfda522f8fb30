"""`reflow finetune`: fine-tune the champion now, in the foreground."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from sqlalchemy import select
from sqlalchemy.orm import Session

from reflow.cli.common import current_db, err_console, fail, load_settings, open_registry
from reflow.scopes import scope_of
from reflow.store.tables import FinetuneRun, aware
from workers.threads import wait_passively

app = typer.Typer(help="Fine-tune the champion on new feedback, and see how runs went.", no_args_is_help=True)
GATE_NUMBERS = ("reward_auc", "reward_auc_lower", "wanted_logp_gain", "unwanted_logp_gain", "regression_kl")
TASK_ACCURACIES = ("held_out_accuracy", "regression_accuracy", "wide_range_accuracy")


@app.command("run")
def finetune_run(
    model: Annotated[str | None, typer.Option(help="Registered model [default: REFLOW_MODEL_NAME].")] = None,
    tenant: Annotated[
        str,
        typer.Option(
            help="Train this tenant's own versions, on its feedback alone [default: the shared model]."
        ),
    ] = "",
) -> None:
    """Fine-tune now, in the foreground, on the labelled feedback that arrived since the last run:
    the shared model's (its tenants' feedback), or with --tenant a tenant's own."""
    wait_passively()  # before torch loads: it trains beside the workers
    from feedback.job_scheduler import finetune_job_of  # APScheduler: 25 ms off `reflow --help`
    from feedback.training.job import run_finetune  # torch, after wait_passively: 1.3 s off `reflow --help`

    settings = load_settings()
    db = current_db(settings)
    registry = open_registry(settings)
    try:
        scope = scope_of(db, tenant)
    except LookupError as error:
        fail(f"{error}")
    columns = (
        TextColumn("[bold]fine-tuning"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err_console) as progress:
        task = progress.add_task("finetune", total=settings.finetune_steps, loss=float("nan"))
        outcome = run_finetune(
            finetune_job_of(settings), db, registry, model=model, scope=scope, min_samples=1,
            progress=lambda step, _total, loss: progress.update(task, completed=step, loss=loss),
        )  # fmt: skip
    err_console.print(f"{outcome.status}: {outcome.message}", highlight=False, soft_wrap=True)
    if outcome.version:
        print(f"registered version {outcome.version} as @{scope.challenger}")
    metrics = outcome.metrics or {}
    for key in GATE_NUMBERS:  # the gate's, then a demo task's accuracies where it has one
        if f"candidate_{key}" in metrics:
            print(f"{key}\t{metrics[f'candidate_{key}']:.3f}")
    for key in TASK_ACCURACIES:
        if f"champion_{key}" in metrics:
            champion, candidate = metrics[f"champion_{key}"], metrics[f"candidate_{key}"]
            print(f"{key}\tchampion {champion:.1%}\tcandidate {candidate:.1%}")
    if outcome.status in ("failed", "skipped"):
        raise typer.Exit(1)


@app.command("runs")
def finetune_runs(
    limit: Annotated[int, typer.Option(min=1, help="The newest this many runs.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per run.")] = False,
) -> None:
    """Fine-tune runs, newest first: status, items used, duration, the version registered, and the
    gate's verdict (or the error), as the scheduler left them."""
    with Session(current_db(load_settings())) as session:
        runs = session.scalars(select(FinetuneRun).order_by(FinetuneRun.id.desc()).limit(limit)).all()
    for run in runs:
        took = (aware(run.finished_at) - aware(run.started_at)).total_seconds() if run.finished_at else None
        row = {
            "id": run.id, "model": run.model, "tenant": run.tenant or None,
            "parent_version": run.parent_version, "status": run.status,
            "samples": run.samples, "started_at": aware(run.started_at).isoformat(), "seconds": took,
            "version": run.version, "message": run.message,
        }  # fmt: skip
        if as_json:
            print(json.dumps(row))
        else:
            duration = f"{took:.0f}s" if took is not None else "running"
            print(f"{run.id}\t{run.model}\t{run.tenant or '(shared)'}\tfrom v{run.parent_version}\t"
                  f"{run.status}\t{run.samples} items\t"
                  f"{duration}\t{('v' + run.version) if run.version else '-'}\t{run.message}")  # fmt: skip
