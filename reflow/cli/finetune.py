"""`reflow finetune`: fine-tune the champion now, in the foreground."""

from __future__ import annotations

from typing import Annotated

import typer

from reflow.cli.common import current_engine, err_console, load_settings, open_registry

app = typer.Typer(help="Fine-tune the champion on new feedback.", no_args_is_help=True)


@app.command("run")
def finetune_run(
    model: Annotated[str | None, typer.Option(help="Registered model [default: REFLOW_MODEL_NAME].")] = None,
) -> None:
    """Fine-tune now, in the foreground, on the labelled feedback that arrived since the last run."""
    from workers.threads import wait_passively

    wait_passively()  # before torch loads: it trains beside the workers
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from feedback.scheduler import finetune_job_of
    from feedback.training.job import run_finetune

    settings = load_settings()
    engine = current_engine(settings)
    registry = open_registry(settings)
    columns = (
        TextColumn("[bold]fine-tuning"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err_console) as progress:
        task = progress.add_task("finetune", total=settings.finetune_steps, loss=float("nan"))
        outcome = run_finetune(
            finetune_job_of(settings), engine, registry, model=model, min_samples=1,
            progress=lambda step, _total, loss: progress.update(task, completed=step, loss=loss),
        )  # fmt: skip
    err_console.print(f"{outcome.status}: {outcome.message}", highlight=False, soft_wrap=True)
    if outcome.version:
        print(f"registered version {outcome.version} as @challenger")
    if outcome.metrics:
        for key in ("held_out_accuracy", "regression_accuracy", "wide_range_accuracy"):
            print(f"{key}\tchampion {outcome.metrics[f'champion_{key}']:.1%}"
                  f"\tcandidate {outcome.metrics[f'candidate_{key}']:.1%}")  # fmt: skip
    if outcome.status in ("failed", "skipped"):
        raise typer.Exit(1)
