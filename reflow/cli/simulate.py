"""`reflow simulate`: simulated users asking through the gateway and rating every answer."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from reflow.cli.common import GatewayCaFile, default_api_key, default_target, err_console, fail, settings_with


def simulate(
    task: Annotated[str | None, typer.Option(help="The task users ask [default: REFLOW_TASK].")] = None,
    rate: Annotated[float, typer.Option(min=0.01, help="Requests per second.")] = 5.0,
    duration: Annotated[float, typer.Option(min=0.0, help="Seconds to run; 0 = until stopped.")] = 60.0,
    lo: Annotated[int | None, typer.Option(min=0, help="Smallest operand (arith) [default: 0].")] = None,
    hi: Annotated[int | None, typer.Option(min=0, help="Largest operand (arith) [default: 99].")] = None,
    users: Annotated[int, typer.Option(min=1, help="Distinct simulated users.")] = 500,
    seed: Annotated[int, typer.Option(help="Seed of the operands and users.")] = 0,
    thumbs_only: Annotated[
        bool, typer.Option("--thumbs-only", help="Users only rate, +1 or -1; they never send a correction.")
    ] = False,
    temperature: Annotated[
        float, typer.Option(min=0.0, max=2.0, help="Sampling temperature of their requests; 0 = greedy.")
    ] = 0.0,
    flip: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of ratings sent the wrong way round (noise).")
    ] = 0.0,
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of their requests.")] = 48,
    target: Annotated[
        str | None, typer.Option(help="Gateway host:port [default: from endpoints.json].")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="REFLOW_API_KEY", show_default=False)] = None,
    ca_file: GatewayCaFile = None,
) -> None:
    """Simulated users: the task's prompts through the gateway, each answer rated by its oracle
    (accuracy is the share the oracle accepted, whatever --flip sent)."""
    # torch: 1.3 s off `reflow --help`
    from feedback.tasks import get_task
    from feedback.tasks.simulate import Behaviour
    from feedback.tasks.simulate import simulate as run_simulation

    ranged = lo is not None or hi is not None  # only arith takes operand ranges
    lo, hi = lo or 0, 99 if hi is None else hi
    if lo > hi:
        fail(f"--lo {lo} is above --hi {hi}", 2)
    settings = settings_with(api_key=api_key or None, gateway_ca_file=ca_file)
    if not (task or settings.task):
        fail("name the task the simulated users ask: --task arith, terse or numbered (or set REFLOW_TASK)", 2)
    try:
        asked = get_task(task or settings.task, **({"traffic": (lo, hi)} if ranged else {}))
    except ValueError as error:
        fail(f"{error}", 2)
    columns = (
        TextColumn("[bold]simulating"), BarColumn(), TextColumn("{task.completed}/{task.total} requests"),
        TextColumn("accuracy {task.fields[accuracy]:.1%}"), TimeElapsedColumn(),
    )  # fmt: skip
    with Progress(*columns, console=err_console) as progress:
        bar = progress.add_task("simulate", total=int(rate * duration) or None, accuracy=0.0)
        report = asyncio.run(
            run_simulation(
                target or default_target(settings), default_api_key(settings), rate=rate,
                task=asked, duration_s=duration, users=users, seed=seed, ca_file=settings.gateway_ca_file,
                on_request=lambda r: progress.update(bar, completed=r.finished, accuracy=r.accuracy),
                behaviour=Behaviour(thumbs_only, temperature, flip, max_tokens),
            )
        )  # fmt: skip
    print(f"requests {report.requests}, accuracy {report.accuracy:.1%}, rated {report.rated}")
    for version, (right, answered) in sorted(report.by_version.items()):
        print(f"version {version}: {right}/{answered} right ({right / answered:.1%})")
    failures = {**report.errors, **report.feedback_errors}
    if failures:
        print("errors: " + ", ".join(f"{code} {n}" for code, n in sorted(failures.items())))
        raise typer.Exit(1)
