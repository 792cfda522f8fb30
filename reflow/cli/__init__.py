"""The `reflow` command line, the composition root: it runs the processes and the commands, and
may import every package (the layers below import nothing from here)."""

from __future__ import annotations

import typer

from reflow.cli import (
    db,
    experiments,
    feedback,
    finetune,
    generate,
    models,
    servers,
    simulate,
    tenants,
    up,
    workers,
)
from reflow.cli.common import Commands

app = typer.Typer(
    cls=Commands,
    help="reflow: a streaming inference gateway that learns from its users.",
    no_args_is_help=True,
)
app.command()(up.up)
app.command()(servers.gateway)
app.command()(servers.worker)
app.command()(generate.generate)
app.add_typer(tenants.app, name="tenants")
app.add_typer(db.app, name="db")
app.add_typer(feedback.app, name="feedback")
app.command()(servers.scheduler)
app.add_typer(finetune.app, name="finetune")
app.command()(simulate.simulate)
app.add_typer(models.app, name="models")
app.add_typer(experiments.app, name="experiments")
app.add_typer(workers.app, name="workers")
