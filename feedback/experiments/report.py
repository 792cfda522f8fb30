"""`reflow experiments report`: one PNG telling an experiment's story.

The time axis runs from the experiment's start to its last evaluation (or its end, if later), with
a margin on each side and never less than MIN_SPAN wide, so an experiment decided at its first
evaluation still gets a bounded, readable axis: times of day in UTC, with the date where it changes.

Top: each arm's positive-feedback rate (weighted by user) at every evaluation, with its 95% Wilson
interval as an error bar, and as a band once there are two evaluations or more; the arms are drawn
slightly apart so their bars do not hide each other. The interval is taken over the arm's effective
sample size, the binomial count its users' variance is worth, so busy users do not narrow it.
Middle: the decision statistic, the mSPRT likelihood ratio each evaluation recorded (log scale),
against the line 1/alpha where the test stops: crossing it promotes a better challenger and rolls a
worse one back. An evaluation that did not run the test (too few ratings yet, or a guardrail or a
skewed split decided first) records 1: those are drawn hollow. The axis ends at CEILING times the
line (a ratio can reach 1e300): a ratio beyond is drawn there as a triangle, the deciding one's
value printed beside it.
Bottom: rated responses per arm.
A vertical line through the panels marks the decision that ended the experiment (or its end, when
it ended otherwise), and the reason is printed below them.

`report_figure` builds the figure; `plot_experiment` writes it as a PNG.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import matplotlib.dates as mdates
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from feedback.experiments.decision import ArmStats, Rules, likelihood_ratio
from feedback.experiments.lifecycle import Look
from reflow.store.tables import Experiment, aware

Z_95 = 1.959964
ARMS = ("champion", "challenger")
COLORS = {"champion": "tab:blue", "challenger": "tab:orange"}
STATISTIC_COLOR = "tab:green"
THRESHOLD_COLOR = "tab:red"
MIN_SPAN = timedelta(minutes=5)  # the narrowest time axis, margins aside
MARGIN = 0.06  # of the span, on each side of the time axis
ARM_OFFSET = 0.006  # of the time axis: how far apart the two arms' points are drawn
CEILING = 1e4  # times the threshold: where the statistic's axis ends (it can reach 1e300)
DPI = 110
# the panels, by the label of their axes (how a test finds them)
RATES, STATISTIC, SAMPLES = "rates", "statistic", "samples"


def wilson_interval(positive: float, n: float, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion: sound at small n and near 0 or 1."""
    if n == 0:
        return 0.0, 1.0
    p = positive / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_interval(arm: ArmStats) -> tuple[float, float]:
    """The Wilson interval of the arm's rate over its effective sample size: the n for which the
    binomial variance rate (1 - rate) / n is the cluster-robust one, and never more than its rated
    responses (users who agree make it no surer than that). Responses are the unit without
    per-user numbers."""
    variance = arm.variance(arm.rate) if arm.users else 0.0
    n = min(arm.rate * (1 - arm.rate) / variance, arm.rated) if variance > 0 else arm.rated
    return wilson_interval(arm.rate * n, n)


def time_span(experiment: Experiment, looks: Sequence[Look]) -> tuple[datetime, datetime]:
    """The time axis: from the experiment's start to its last evaluation or its end, whichever is
    later, at least MIN_SPAN wide, with a MARGIN of that on each side."""
    moments = [aware(experiment.started_at), *(look.at for look in looks)]
    if experiment.ended_at is not None:
        moments.append(aware(experiment.ended_at))
    first, last = min(moments), max(moments)
    span = max(last - first, MIN_SPAN)
    return first - span * MARGIN, first + span * (1 + MARGIN)


def tested(look: Look) -> bool:
    """Whether the sequential test ran at `look`: its recorded likelihood ratio is the one its arms'
    numbers give (an evaluation that decided before the test records 1)."""
    if min(look.champion.rated, look.challenger.rated) == 0:
        return False
    ratio, _ = likelihood_ratio(look.champion, look.challenger)
    return math.isclose(ratio, look.likelihood_ratio, rel_tol=1e-6)


def report_figure(experiment: Experiment, looks: Sequence[Look], *, alpha: float = Rules().alpha) -> Figure:
    """The report of `experiment` and its evaluations `looks` (oldest first), tested at `alpha`."""
    fig = Figure(figsize=(10, 9.5), dpi=DPI, layout="constrained")
    rates, statistic, samples = fig.subplots(3, 1, sharex=True, height_ratios=(3, 1.7, 1.2))
    panels = (rates, statistic, samples)
    for axis, label in zip(panels, (RATES, STATISTIC, SAMPLES), strict=True):
        axis.set_label(label)
        axis.grid(alpha=0.3)
    left, right = (_x(moment) for moment in time_span(experiment, looks))
    offset = (right - left) * ARM_OFFSET
    versions = {"champion": experiment.champion_version, "challenger": experiment.challenger_version}
    for arm, shift in zip(ARMS, (-offset, offset), strict=True):
        times = [_x(look.at) + shift for look in looks]
        _plot_arm(rates, samples, arm, f"{arm} v{versions[arm]}", looks, times)
    _plot_statistic(statistic, looks, alpha)

    start = _x(aware(experiment.started_at))
    for axis in panels:
        axis.axvline(start, color="grey", linestyle=":", linewidth=1)
    rates.annotate(
        " started", (start, 0.98), xycoords=rates.get_xaxis_transform(), fontsize=8, va="top", color="grey"
    )
    _mark_end(experiment, looks, alpha, rates, statistic, samples)

    rates.set_ylabel("positive-feedback rate\n(95% Wilson interval)")
    if looks:
        rates.set_ylim(*_rate_limits(looks))
        rates.legend(loc="lower left", bbox_to_anchor=(0, 1.01), ncols=2, frameon=False, fontsize=9)
    else:
        rates.set_ylim(0, 1)
        rates.text(0.5, 0.5, "not evaluated yet", transform=rates.transAxes, ha="center")
    samples.set_ylabel("rated responses")
    samples.set_ylim(bottom=0)
    samples.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    samples.set_xlabel("evaluation time (UTC)")
    samples.set_xlim(left, right)
    locator = mdates.AutoDateLocator(tz=UTC, minticks=5, maxticks=10)
    locator.intervald[mdates.MINUTELY] = [1, 2, 5, 10, 15, 30]  # 2-minute ticks over a quarter hour
    samples.xaxis.set_major_locator(locator)
    samples.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=UTC))
    fig.suptitle(
        f"experiment {experiment.id}: {experiment.model} v{experiment.challenger_version} (challenger) vs "
        f"v{experiment.champion_version} (champion), {experiment.traffic:.0%} of "
        f"{f'tenant {experiment.tenant}' if experiment.tenant else 'shared'} traffic to the challenger"
        f" — {experiment.status}",
        fontsize=10,
    )
    reason = _reason(experiment, looks)
    if reason:
        fig.supxlabel(textwrap.fill(reason, 160), fontsize=8, ha="left", x=0.01)
    return fig


def plot_experiment(
    experiment: Experiment, looks: Sequence[Look], out: Path, *, alpha: float = Rules().alpha
) -> None:
    """Writes the experiment's report (`report_figure`) to `out` as a PNG."""
    fig = report_figure(experiment, looks, alpha=alpha)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=DPI)


def _x(moment: datetime) -> float:
    """A moment where the time axis puts it (matplotlib's days since its epoch)."""
    return float(mdates.date2num(moment))


def _plot_arm(
    rates: Axes, samples: Axes, arm: str, label: str, looks: Sequence[Look], times: list[float]
) -> None:
    """One arm: its rate with its interval at each evaluation (`times`, shifted off the other arm's),
    and its rated responses."""
    if not looks:
        return
    stats = [getattr(look, arm) for look in looks]
    rate = [s.rate for s in stats]
    intervals = [rate_interval(s) for s in stats]
    low, high = [lo for lo, _ in intervals], [hi for _, hi in intervals]
    color = COLORS[arm]
    if len(looks) >= 2:
        rates.fill_between(times, low, high, color=color, alpha=0.15, linewidth=0, label=f"_{arm} band")
    errors = [
        [r - lo for r, lo in zip(rate, low, strict=True)],
        [hi - r for r, hi in zip(rate, high, strict=True)],
    ]
    rates.errorbar(
        times, rate, yerr=errors, fmt="-o", markersize=4, capsize=3, linewidth=1.2, color=color, label=label
    )  # fmt: skip
    samples.plot(times, [s.rated for s in stats], "-o", markersize=3, color=color, label=label)


def _rate_limits(looks: Sequence[Look]) -> tuple[float, float]:
    """The rate axis: every interval, with room above them for the labels along the top."""
    intervals = [rate_interval(s) for look in looks for s in (look.champion, look.challenger)]
    low, high = min(lo for lo, _ in intervals), max(hi for _, hi in intervals)
    pad = max(high - low, 0.05)
    return max(0.0, low - 0.08 * pad), min(1.0, high + 0.18 * pad)


def _plot_statistic(axis: Axes, looks: Sequence[Look], alpha: float) -> None:
    """The likelihood ratio of each evaluation, against the line 1/alpha where the test stops. The
    axis ends at CEILING times that line: a larger ratio is drawn there, as a triangle."""
    threshold = 1 / alpha
    ceiling = threshold * CEILING
    times = [_x(look.at) for look in looks]
    ratios = [min(look.likelihood_ratio, ceiling) for look in looks]
    kinds = [
        "untested" if not tested(look) else "tested" if ratio < ceiling else "above"
        for look, ratio in zip(looks, ratios, strict=True)
    ]
    axis.set_yscale("log")
    axis.plot(times, ratios, color=STATISTIC_COLOR, linewidth=1, zorder=2)
    for kind, marker, label in (
        ("tested", "o", "likelihood ratio Λ"),
        ("above", "^", f"Λ above {ceiling:.3g}, drawn at the top"),
        ("untested", "o", "test not run (too few ratings, or a check decided first): Λ recorded as 1"),
    ):
        points = [(t, r) for t, r, k in zip(times, ratios, kinds, strict=True) if k == kind]
        if points:
            axis.scatter(
                [t for t, _ in points], [r for _, r in points], s=22, marker=marker, zorder=3, label=label,
                color="white" if kind == "untested" else STATISTIC_COLOR, edgecolors=STATISTIC_COLOR,
            )  # fmt: skip
    axis.axhline(threshold, color=THRESHOLD_COLOR, linestyle="--", linewidth=1.2, label="_threshold")
    axis.axhline(1, color="grey", linewidth=0.8)
    axis.annotate(
        f"1/$\\alpha$ = {threshold:.3g} ($\\alpha$ = {alpha:.3g}): above it the test stops, "
        "promoting a better challenger or rolling back a worse one",
        (0.01, threshold), xycoords=axis.get_yaxis_transform(), xytext=(0, 3), textcoords="offset points",
        fontsize=8, color=THRESHOLD_COLOR, va="bottom",
    )  # fmt: skip
    top, bottom = max([threshold, *ratios]), min([1.0, *ratios])
    axis.set_ylim(bottom / 3, top * 30)  # room above for the legend and the labels, below for Λ = 1
    axis.set_ylabel("decision statistic\nmSPRT likelihood ratio")
    if looks:
        axis.legend(loc="upper left", fontsize=8, framealpha=0.9)


def _ended(experiment: Experiment, looks: Sequence[Look]) -> tuple[datetime, str] | None:
    """When and how the experiment ended: the decision of its last evaluation, or its end time and
    status when it ended otherwise; None while it runs."""
    if looks and looks[-1].outcome != "continue":
        return looks[-1].at, looks[-1].outcome
    if experiment.ended_at is not None:
        return aware(experiment.ended_at), experiment.status
    return None


def _reason(experiment: Experiment, looks: Sequence[Look]) -> str:
    """What the report says below the panels: why it ended, else what the last evaluation found."""
    if looks and looks[-1].outcome != "continue":
        return f"{looks[-1].outcome}: {looks[-1].reason}"
    if experiment.ended_at is not None and experiment.reason:
        return f"{experiment.status}: {experiment.reason}"
    if looks:
        return f"latest evaluation: {looks[-1].reason}"
    return ""


def _mark_end(
    experiment: Experiment, looks: Sequence[Look], alpha: float, rates: Axes, statistic: Axes, samples: Axes
) -> None:
    """A vertical line through every panel where the experiment ended, labelled with how; on the
    statistic panel, the ratio that decided it."""
    ended = _ended(experiment, looks)
    if ended is None:
        return
    at, outcome = ended
    for axis in (rates, statistic, samples):
        axis.axvline(_x(at), color="black", linestyle="--", linewidth=1)
    # the end is at the right of the axis: labels go to the left of the line
    rates.annotate(
        f"{outcome} ", (_x(at), 0.98), xycoords=rates.get_xaxis_transform(), fontsize=9, va="top",
        ha="right", fontweight="bold",
    )  # fmt: skip
    last = looks[-1] if looks else None
    if last is not None and last.at == at and tested(last):
        shown = min(last.likelihood_ratio, CEILING / alpha)
        statistic.annotate(
            f"Λ = {last.likelihood_ratio:.3g}, challenger {100 * last.difference:+.1f} points",
            (_x(at), shown), xytext=(-8, 6), textcoords="offset points", fontsize=8,
            ha="right", va="bottom",
        )  # fmt: skip
