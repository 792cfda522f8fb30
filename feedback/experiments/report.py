"""`reflow experiments report`: one PNG telling an experiment's story.

Top: each arm's positive-feedback rate at every evaluation, with a 95% Wilson interval as a band.
Bottom: rated responses per arm. A vertical line marks the decision that ended the experiment.
"""

from __future__ import annotations

import math
from pathlib import Path

from feedback.experiments.lifecycle import Look
from reflow.store.tables import Experiment

Z_95 = 1.959964
COLORS = {"champion": "tab:blue", "challenger": "tab:orange"}


def wilson_interval(positive: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion: sound at small n and near 0 or 1."""
    if n == 0:
        return 0.0, 1.0
    p = positive / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def plot_experiment(experiment: Experiment, looks: list[Look], out: Path) -> None:
    """Writes the experiment's report to `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (rates, samples) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 1.4))
    times = [look.at for look in looks]
    for arm, version in (
        ("champion", experiment.champion_version),
        ("challenger", experiment.challenger_version),
    ):
        stats = [getattr(look, arm) for look in looks]
        bands = [wilson_interval(s.positive, s.rated) for s in stats]
        label = f"{arm} v{version}"
        rates.plot(times, [s.rate for s in stats], marker=".", color=COLORS[arm], label=label)
        rates.fill_between(
            times, [lo for lo, _ in bands], [hi for _, hi in bands], color=COLORS[arm], alpha=0.2
        )
        samples.plot(times, [s.rated for s in stats], marker=".", color=COLORS[arm], label=label)
    ended = looks[-1] if looks and looks[-1].outcome != "continue" else None
    if ended is not None:
        for axis in (rates, samples):
            axis.axvline(ended.at, color="black", linestyle="--", linewidth=1)
        rates.annotate(f" {ended.outcome}", (ended.at, 0.97), fontsize=9, va="top")
    rates.set_ylim(0, 1)
    rates.set_ylabel("positive-feedback rate (95% band)")
    rates.legend(loc="lower right")
    rates.grid(alpha=0.3)
    samples.set_ylabel("rated responses")
    samples.set_xlabel("evaluation time (UTC)")
    samples.grid(alpha=0.3)
    title = (
        f"experiment {experiment.id}: {experiment.model} v{experiment.challenger_version} vs "
        f"v{experiment.champion_version}, {experiment.traffic:.0%} to the challenger — {experiment.status}"
    )
    rates.set_title(title, fontsize=10)
    if ended is not None:
        fig.text(0.01, 0.005, ended.reason, fontsize=7, wrap=True)
    elif not looks:
        rates.text(0.5, 0.5, "not evaluated yet", transform=rates.transAxes, ha="center")
    fig.autofmt_xdate()
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
