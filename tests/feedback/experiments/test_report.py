"""`reflow experiments report`'s figure, from real Experiment rows and Looks as the decision rule
makes them: a time axis bounded to the experiment, each arm's interval at every evaluation, and the
decision statistic against its threshold — for one evaluation and for many."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import matplotlib.dates as mdates
import matplotlib.image
import pytest
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure

from feedback.experiments.decision import ArmStats, Rules, decide
from feedback.experiments.lifecycle import ENDED_BY, Look
from feedback.experiments.report import (
    CEILING,
    MARGIN,
    MIN_SPAN,
    RATES,
    SAMPLES,
    STATISTIC,
    plot_experiment,
    report_figure,
    wilson_interval,
)
from reflow.store.tables import Experiment

START = datetime(2026, 3, 4, 9, 58, 12, tzinfo=UTC)
RULES = Rules(alpha=0.05, min_samples=100, traffic=0.5)
PNG = b"\x89PNG\r\n\x1a\n"


def arms(rated: int, champion_rate: float, challenger_rate: float) -> tuple[ArmStats, ArmStats]:
    def arm(rate: float) -> ArmStats:
        return ArmStats(rated=rated, positive=round(rate * rated), requests=rated + 7, units=rated + 7)

    return arm(champion_rate), arm(challenger_rate)


def evaluations(every: timedelta, rated: list[int], rates: tuple[float, float]) -> list[Look]:
    """One look per entry of `rated` (ratings per arm so far), `every` apart from START, decided by
    the real rule; they stop at the first one that ends the experiment."""
    looks = []
    for i, n in enumerate(rated, start=1):
        champion, challenger = arms(n, *rates)
        decision = decide(champion, challenger, RULES)
        looks.append(
            Look(
                at=START + i * every, outcome=decision.outcome, reason=decision.reason, champion=champion,
                challenger=challenger, likelihood_ratio=decision.likelihood_ratio,
                difference=decision.difference, srm_p=decision.srm_p,
            )
        )  # fmt: skip
        if decision.outcome != "continue":
            break
    return looks


def experiment_of(looks: list[Look]) -> Experiment:
    """The experiment those looks tell of, ended a moment after its last one when that decided."""
    last = looks[-1]
    decided = last.outcome in ENDED_BY
    return Experiment(
        id=7, model="arith", champion_version="1", challenger_version="2", traffic=RULES.traffic,
        status=ENDED_BY[last.outcome] if decided else "running", reason=last.reason if decided else "",
        started_at=START, ended_at=last.at + timedelta(seconds=2) if decided else None,
    )  # fmt: skip


@pytest.fixture
def one_look() -> tuple[Experiment, list[Look]]:
    """Steady traffic: 400 ratings per arm by the first evaluation, 5 minutes in, which promotes."""
    looks = evaluations(timedelta(minutes=5), [400], (0.30, 0.44))
    assert [look.outcome for look in looks] == ["promote"]
    return experiment_of(looks), looks


@pytest.fixture
def twelve_looks() -> tuple[Experiment, list[Look]]:
    """A trickle: 20 more ratings per arm each minute; the first four evaluations wait for
    min_samples, the twelfth promotes."""
    looks = evaluations(timedelta(minutes=1), [20 * i for i in range(1, 20)], (0.30, 0.44))
    assert [look.outcome for look in looks] == ["continue"] * 11 + ["promote"]
    return experiment_of(looks), looks


def axis(figure: Figure, label: str) -> Axes:
    [found] = [a for a in figure.axes if a.get_label() == label]
    return found


def check_report(experiment: Experiment, looks: list[Look], out: Path) -> None:
    figure = report_figure(experiment, looks, alpha=RULES.alpha)
    figure.canvas.draw()  # lays out and formats the ticks as the PNG has them

    # the time axis is the experiment's, with its margin: never years of empty axis
    end = max(looks[-1].at, experiment.ended_at or looks[-1].at)
    span = max(end - START, MIN_SPAN)
    low, high = (mdates.num2date(x) for x in axis(figure, SAMPLES).get_xlim())
    slack = timedelta(seconds=1)
    assert START - span * MARGIN - slack <= low < START and end < high <= START + span * (1 + MARGIN) + slack
    assert high - low <= span * (1 + 2 * MARGIN) + slack
    for label in (RATES, STATISTIC):  # the panels share it
        assert axis(figure, label).get_xlim() == axis(figure, SAMPLES).get_xlim()
    ticks = [t.get_text() for t in axis(figure, SAMPLES).get_xticklabels() if t.get_text()]
    assert len(ticks) >= 3 and all(":" in t for t in ticks), ticks  # times of day

    # every arm has its 95% interval at every look, the arms drawn apart
    rates = axis(figure, RATES)
    bars = {c.get_label(): c for c in rates.containers if isinstance(c, ErrorbarContainer)}
    assert set(bars) == {"champion v1", "challenger v2"}
    xs = {}
    for arm, container in zip(
        ("champion", "challenger"), (bars["champion v1"], bars["challenger v2"]), strict=True
    ):
        [segments] = [c.get_segments() for c in container.lines[2]]
        assert len(segments) == len(looks)
        for look, segment in zip(looks, segments, strict=True):
            stats = getattr(look, arm)
            (x0, y0), (x1, y1) = segment
            assert x0 == x1 and (y0, y1) == pytest.approx(wilson_interval(stats.positive, stats.rated))
        xs[arm] = [x for (x, _), _ in segments]
    assert all(c < h for c, h in zip(xs["champion"], xs["challenger"], strict=True))
    bands = [c for c in rates.collections if isinstance(c, PolyCollection)]
    assert len(bands) == (2 if len(looks) >= 2 else 0)

    # the statistic at every look, on a log scale, against 1/alpha
    statistic = axis(figure, STATISTIC)
    assert statistic.get_yscale() == "log"
    thresholds = [line for line in statistic.get_lines() if list(line.get_ydata()) == [20.0, 20.0]]
    assert len(thresholds) == 1 and any("= 20 " in t.get_text() for t in statistic.texts)
    markers = sorted(float(y) for c in statistic.collections for _, y in c.get_offsets())  # filled and hollow
    assert markers == pytest.approx(sorted(look.likelihood_ratio for look in looks))
    assert statistic.get_ylim()[0] < 1 and statistic.get_ylim()[1] > max(20.0, *markers)
    assert statistic.get_legend() is not None

    # the decision marked across the panels and named
    decided = mdates.date2num(looks[-1].at)
    for label in (RATES, STATISTIC, SAMPLES):
        assert any(list(line.get_xdata()) == [decided] * 2 for line in axis(figure, label).get_lines())
    assert any(t.get_text().strip() == looks[-1].outcome for t in rates.texts)

    plot_experiment(experiment, looks, out, alpha=RULES.alpha)
    assert out.read_bytes()[:8] == PNG
    height, width, _ = matplotlib.image.imread(out).shape
    assert (width, height) == (1100, 1045)


def test_one_evaluation_gets_a_bounded_axis_and_intervals(
    one_look: tuple[Experiment, list[Look]], tmp_path: Path
) -> None:
    check_report(*one_look, tmp_path / "report-1.png")


def test_many_evaluations_get_bands_and_the_statistic_crossing_its_threshold(
    twelve_looks: tuple[Experiment, list[Look]], tmp_path: Path
) -> None:
    experiment, looks = twelve_looks
    check_report(experiment, looks, tmp_path / "report-12.png")
    waiting = [look for look in looks if "waiting" in look.reason]
    assert len(waiting) == 4 and all(look.likelihood_ratio == 1.0 for look in waiting)
    statistic = axis(report_figure(experiment, looks), STATISTIC)
    hollow = [c for c in statistic.collections if c.get_label().startswith("test not run")]
    assert len(hollow) == 1 and len(hollow[0].get_offsets()) == 4


def test_an_experiment_not_evaluated_yet_still_gets_a_bounded_axis() -> None:
    experiment = Experiment(
        id=8, model="arith", champion_version="1", challenger_version="2", traffic=0.1, status="running",
        started_at=START,
    )  # fmt: skip
    figure = report_figure(experiment, [])
    low, high = (mdates.num2date(x) for x in axis(figure, SAMPLES).get_xlim())
    assert low < START < high and high - low <= MIN_SPAN * (1 + 2 * MARGIN) + timedelta(seconds=1)
    assert any("not evaluated yet" in t.get_text() for t in axis(figure, RATES).texts)


def test_a_huge_likelihood_ratio_is_drawn_at_the_top_of_a_bounded_axis() -> None:
    """20000 ratings per arm at the first look: Λ ~ 1e180, which would leave the threshold a
    sliver at the bottom of 180 decades."""
    looks = evaluations(timedelta(minutes=3), [20_000], (0.30, 0.44))
    assert looks[0].outcome == "promote" and looks[0].likelihood_ratio > 1e100
    statistic = axis(report_figure(experiment_of(looks), looks, alpha=RULES.alpha), STATISTIC)
    ceiling = 20.0 * CEILING
    [marker] = [c for c in statistic.collections if c.get_label().startswith("Λ above")]
    assert float(marker.get_offsets()[0][1]) == pytest.approx(ceiling)
    assert statistic.get_ylim()[1] <= ceiling * 100
    assert any(f"Λ = {looks[0].likelihood_ratio:.3g}" in t.get_text() for t in statistic.texts)
