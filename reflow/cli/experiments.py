"""`reflow experiments`: A/B experiments, their evaluations and a plot of each."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from reflow.cli.common import console, current_db, fail, load_settings
from reflow.store.tables import aware

app = typer.Typer(help="A/B experiments of challengers against champions.", no_args_is_help=True)
SHOWN_EVALUATIONS = 20  # `experiments show` lists the latest ones; `report` plots them all


def _arm_summary(look: Any) -> dict[str, Any]:
    """The numbers of one evaluation, per arm, as JSON-ready values."""
    return {
        "decided_at": look.at.isoformat(), "outcome": look.outcome, "reason": look.reason,
        "champion": asdict(look.champion), "challenger": asdict(look.challenger),
        "likelihood_ratio": look.likelihood_ratio, "difference": look.difference, "srm_p": look.srm_p,
    }  # fmt: skip


def _rated(arm: Any) -> str:
    """An arm's positive and rated responses, and by how many users when known."""
    return f"{arm.positive}/{arm.rated}" + (f" ({arm.users} users)" if arm.users else "")


def _experiment_summary(experiment: Any) -> dict[str, Any]:
    return {
        "id": experiment.id, "model": experiment.model,
        "tenant": experiment.tenant or None,  # whose own versions it tests; None: the shared model's
        "champion_version": experiment.champion_version,
        "challenger_version": experiment.challenger_version, "traffic": experiment.traffic,
        "status": experiment.status, "reason": experiment.reason,
        "started_at": aware(experiment.started_at).isoformat(),
        "ended_at": aware(experiment.ended_at).isoformat() if experiment.ended_at else None,
    }  # fmt: skip


@app.command("list")
def experiments_list(
    name: Annotated[str | None, typer.Argument(help="Only this model's experiments.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """Experiments, newest first: the tenant whose versions each tests (or the shared model's),
    versions, split, status and the latest numbers per arm."""
    from feedback.experiments.lifecycle import experiments  # numpy: 95 ms off `reflow --help`

    found = experiments(current_db(load_settings()), name)
    if as_json:
        rows = [
            {**_experiment_summary(e), "latest": _arm_summary(look) if look else None} for e, look in found
        ]
        print(json.dumps(rows))
        return
    for e, look in found:
        numbers = "-"
        if look is not None:
            numbers = f"champion {_rated(look.champion)}, challenger {_rated(look.challenger)} positive"
        print(f"{e.id}\t{e.model}\t{e.tenant or '(shared)'}\t"
              f"v{e.champion_version} vs v{e.challenger_version}\t"
              f"{e.traffic:.0%}\t{e.status}\t{e.started_at:%Y-%m-%d %H:%M:%S}\t{numbers}")  # fmt: skip


def _history(experiment_id: int) -> tuple[Any, list[Any]]:
    """An experiment and its evaluations; exit status 1 when there is no such experiment."""
    from feedback.experiments.lifecycle import history  # numpy: 95 ms off `reflow --help`

    try:
        return history(current_db(load_settings()), experiment_id)
    except LookupError as error:
        fail(f"{error}")


@app.command("show")
def experiments_show(experiment_id: int) -> None:
    """One experiment: its versions, its status and why, and every evaluation with its numbers."""
    from feedback.experiments.lifecycle import variant_mix  # numpy: 95 ms off `reflow --help`

    experiment, looks = _history(experiment_id)
    for key, value in _experiment_summary(experiment).items():
        print(f"{key}\t{value if value is not None else '-'}")
    for arm, counts in variant_mix(current_db(load_settings()), experiment_id).items():
        served = ", ".join(f"{variant or 'as loaded'} {n}" for variant, n in sorted(counts.items()))
        print(f"{arm} variants\t{served or '-'}")
    shown = looks[-SHOWN_EVALUATIONS:]
    table = Table(title=f"the last {len(shown)} of {len(looks)} evaluation(s)")
    for column in ("time", "outcome", "champion +/rated", "challenger +/rated", "LR", "SRM p", "reason"):
        table.add_column(column)
    for look in shown:
        table.add_row(
            f"{look.at:%Y-%m-%d %H:%M:%S}", look.outcome,
            _rated(look.champion), _rated(look.challenger),
            f"{look.likelihood_ratio:.3g}", f"{look.srm_p:.2g}", look.reason,
        )  # fmt: skip
    console.print(table)


@app.command("report")
def experiments_report(
    experiment_id: int,
    out: Annotated[Path, typer.Option("--out", help="PNG file to write.")],
) -> None:
    """Plot an experiment: per-arm positive rate with 95% intervals at each evaluation, the test's
    statistic against its threshold, samples, the decision."""
    from feedback.experiments.report import plot_experiment  # matplotlib: 550 ms off `reflow --help`

    experiment, looks = _history(experiment_id)
    plot_experiment(experiment, looks, out, alpha=load_settings().ab_alpha)
    print(f"wrote {out}")
