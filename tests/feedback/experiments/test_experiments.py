"""Experiments in the store (SQLite and PostgreSQL) and a real MLflow registry: sticky assignment,
opening and ending with the aliases, per-arm numbers, and the evaluate job acting on synthetic
streams — promote, roll back, keep going, flag a skewed split — with every decision recorded."""

from __future__ import annotations

import json
import random
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from feedback.events import FeedbackEvent, InferenceEvent, Latency, Routing, TokenUsage
from feedback.experiments.decision import Rules, decide
from feedback.experiments.job import Evaluation, evaluate_experiments
from feedback.experiments.lifecycle import arm_stats, history, reconcile, record, variant_mix
from feedback.experiments.promotion import promote
from feedback.intake.consumer import store_events
from feedback.job_scheduler import evaluate_job_of, finetune_job_of
from feedback.training.job import run_finetune
from gateway.assignment import assigned_arm
from gateway.tenants import create_tenant
from reflow.registry import CHALLENGER, CHAMPION, Registry, tenant_alias
from reflow.scopes import Scope
from reflow.settings import Settings
from reflow.store.experiments import RunningExperiment, running_experiment
from reflow.store.tables import (
    TRAINS_NOTHING,
    TRAINS_OWN,
    TRAINS_SHARED,
    Experiment,
    ExperimentDecision,
    utcnow,
)
from tests.support.cli import reflow
from tests.support.models import MODEL, save_model, tiny_model
from tests.support.registry import local_registry

KEY = bytes(range(32))  # the assignment key; a gateway takes the store's (reflow/store/secrets.py)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    """arith v1 and v2 (tiny random models); each test sets the aliases it starts from."""
    root = tmp_path_factory.mktemp("experiments")
    registry = local_registry(root)
    for seed, alias in ((0, CHAMPION), (1, CHALLENGER)):
        directory = save_model(tiny_model(seed), root / f"v{seed}")
        registry.register(MODEL, directory, params={}, metrics={}, alias=alias)
    return registry


@pytest.fixture
def aliases(registry: Registry) -> Registry:
    """v1 @champion, v2 @challenger."""
    registry.set_alias(MODEL, CHAMPION, "1")
    registry.set_alias(MODEL, CHALLENGER, "2")
    return registry


@pytest.fixture
def experiment(store: Engine, aliases: Registry) -> RunningExperiment:
    """v2 tested against v1, half the users on each."""
    opened = reconcile(store, aliases, MODEL, 0.5)
    assert opened is not None
    return opened


def evaluate_once(store: Engine, aliases: Registry, tmp_path: Path) -> Evaluation:
    """The one evaluation a round makes."""
    [evaluation] = evaluate_experiments(evaluate_job_of(settings(tmp_path)), store, aliases)
    return evaluation


def settings(tmp_path: Path, **overrides: object) -> Settings:
    values = {"ab_min_samples": 100, "ab_traffic": 0.5, "data_dir": tmp_path, **overrides}
    return Settings(**values)


def served(
    experiment_id: int,
    request_id: str,
    user: str,
    arm: str,
    *,
    tenant: str = "acme",
    failed: bool = False,
    total_ms: float = 10,
    variant: str = "",
) -> InferenceEvent:
    """The inference event of one request the experiment assigned to `arm`."""
    return InferenceEvent(
        request_id=request_id, tenant=tenant, user_id=user, model=MODEL,
        version="2" if arm == CHALLENGER else "1", arm=arm, experiment=experiment_id,
        prompt="1+2=", completion="" if failed else "3", finish_reason="ERROR" if failed else "STOP",
        usage=TokenUsage(prompt_tokens=4, completion_tokens=1, reasoning_tokens=0),
        latency=Latency(first_token_ms=5, total_ms=total_ms), time=utcnow(),
        routing=Routing(variant=variant, latency_budget_ms=500, predicted_first_token_ms=4,
                        predicted_total_ms=9),
    )  # fmt: skip


def rated(request_id: str, user: str, rating: int, *, tenant: str = "acme", n: int = 0) -> FeedbackEvent:
    """The `n`th rating of a request."""
    return FeedbackEvent(
        feedback_id=f"fb-{request_id}-{n}", request_id=request_id, tenant=tenant, rating=rating,
        user_id=user, time=utcnow(),
    )  # fmt: skip


def traffic(
    store: Engine,
    experiment_id: int,
    rates: dict[str, float],
    users: int,
    *,
    traffic_share: float = 0.5,
    skew: float | None = None,
    errors: dict[str, float] | None = None,
    seed: int = 0,
    variants: tuple[str, ...] = ("",),
) -> None:
    """Stores what `users` users did: one rated request each, assigned as the gateway would (or
    with `skew` of them on the challenger, for a broken split), positive with the arm's rate, served
    by `variants` in turn."""
    rng = random.Random(seed)
    events: list[InferenceEvent | FeedbackEvent] = []
    for i in range(users):
        user = f"user-{seed}-{i}"
        if skew is None:
            arm = assigned_arm(KEY, experiment_id, "acme", user, traffic_share)
        else:
            arm = CHALLENGER if rng.random() < skew else CHAMPION
        failed = rng.random() < (errors or {}).get(arm, 0.0)
        request_id = f"req-{experiment_id}-{seed}-{i}"
        events.append(
            served(experiment_id, request_id, user, arm, failed=failed, total_ms=10 + i % 10,
                   variant=variants[i % len(variants)])
        )  # fmt: skip
        if not failed:
            events.append(rated(request_id, user, 1 if rng.random() < rates[arm] else -1))
    with store.begin() as connection:
        store_events(connection, events)


def test_assignment_is_sticky_and_follows_the_traffic_share() -> None:
    units = [f"user-{i}" for i in range(20_000)]
    arms = [assigned_arm(KEY, 7, "acme", u, 0.1) for u in units]
    assert arms == [assigned_arm(KEY, 7, "acme", u, 0.1) for u in units]  # the same user, the same arm
    assert abs(arms.count(CHALLENGER) / len(arms) - 0.1) < 0.01
    for other in (
        [assigned_arm(KEY, 8, "acme", u, 0.1) for u in units],  # a new experiment draws afresh
        [assigned_arm(KEY, 7, "globex", u, 0.1) for u in units],  # so does another tenant's same name
        [assigned_arm(b"another key".ljust(32), 7, "acme", u, 0.1) for u in units],  # and another key:
    ):  # a client who knows the experiment and a user id cannot tell its arm without the server's
        both = sum(a == b == CHALLENGER for a, b in zip(arms, other, strict=True))
        assert abs(both / len(units) - 0.01) < 0.005


def test_an_experiment_opens_with_a_challenger_and_ends_when_aliases_move_by_hand(
    store: Engine, aliases: Registry
) -> None:
    opened = reconcile(store, aliases, MODEL, 0.2)
    assert opened is not None and (opened.champion_version, opened.challenger_version) == ("1", "2")
    assert reconcile(store, aliases, MODEL, 0.2) == opened  # one experiment per challenger
    with pytest.raises(IntegrityError), Session(store) as session, session.begin():
        session.add(Experiment(model=MODEL, champion_version="1", challenger_version="2", traffic=0.2,
                               status="running"))  # fmt: skip
    aliases.delete_alias(MODEL, CHALLENGER)  # rolled back in the MLflow UI
    assert reconcile(store, aliases, MODEL, 0.2) is None
    experiment, _ = history(store, opened.id)
    assert experiment.status == "ended" and "challenger none" in experiment.reason
    aliases.set_alias(MODEL, CHALLENGER, "2")  # set again by hand: a new experiment
    again = reconcile(store, aliases, MODEL, 0.2)
    assert again is not None and again.id != opened.id


def test_arm_numbers_come_from_the_experiments_inferences_and_their_feedback(
    store: Engine, aliases: Registry, experiment: RunningExperiment
) -> None:
    traffic(store, experiment.id, {CHAMPION: 0.0, CHALLENGER: 1.0}, users=400,
            errors={CHALLENGER: 0.1})  # fmt: skip
    stats = arm_stats(store, experiment.id, Rules().max_per_user)
    champion, challenger = stats[CHAMPION], stats[CHALLENGER]
    assert champion.requests + challenger.requests == 400
    assert champion.units == champion.requests and challenger.units == challenger.requests
    assert champion.positive == 0 and champion.rated == champion.requests
    assert (
        challenger.errors > 0
        and challenger.rated == challenger.positive == challenger.requests - challenger.errors
    )
    assert champion.errors == 0 and champion.p95_latency_ms == 19.0


def test_a_busy_user_weighs_no_more_than_max_per_user_responses(
    store: Engine, aliases: Registry, experiment: RunningExperiment
) -> None:
    """On the champion: ten users rate two answers each, six liking one (one of them by adding a +1
    to a -1), four neither; a busy user rates twenty, all liked; the same id in another tenant, a
    different person, dislikes two; two requests without a user are liked. Per response the rate
    is 28/44; per user, the busy one weighs the cap, 5, the others what they rated:
    (5*1 + 6*2*0.5 + 2*1) / (5 + 10*2 + 2 + 2*1) = 13/29."""
    events: list[InferenceEvent | FeedbackEvent] = []

    def rate(user: str, ratings: list[int], tenant: str = "acme") -> None:
        for i, rating in enumerate(ratings):
            request_id = f"{tenant}-{user or 'anonymous'}-{i}"
            events.extend((served(experiment.id, request_id, user, CHAMPION, tenant=tenant),
                           rated(request_id, user, rating, tenant=tenant)))  # fmt: skip

    rate("busy", [1] * 20)
    for i in range(10):
        rate(f"user-{i}", [1, -1] if i < 5 else [-1, -1])
    rate("busy", [-1, -1], tenant="globex")  # another person
    rate("", [1, 1])  # each request a unit of its own
    events.append(rated("acme-user-9-0", "user-9", 1, n=1))  # a completion counts as liked once
    events.append(rated("acme-user-8-0", "user-8", 0, n=1))  # no rating: not counted
    with store.begin() as connection:
        store_events(connection, events)

    stats = arm_stats(store, experiment.id, max_per_user=5)
    champion = stats[CHAMPION]
    assert (champion.rated, champion.positive, champion.users) == (44, 28, 14)
    assert (champion.weight, champion.weighted_positive) == (29, pytest.approx(13))
    assert champion.rate == pytest.approx(13 / 29)
    without_busy = 8 / 24  # the others' rate: the busy user moves it by at most its 5 of 29
    assert champion.rate - without_busy == pytest.approx(5 / 29 * (1 - without_busy))
    # sum(w^2 (mean - r)^2) / (sum w)^2 over (w, mean): the busy (5, 1), the six who liked one
    # (2, 1/2), the four who liked none and the other tenant's user (2, 0), the anonymous (1, 1)
    units = [(5, 1.0)] + [(2, 0.5)] * 6 + [(2, 0.0)] * 5 + [(1, 1.0)] * 2
    r = champion.rate
    assert champion.variance(r) == pytest.approx(sum(w * w * (m - r) ** 2 for w, m in units) / 29**2)
    assert stats[CHALLENGER].rated == stats[CHALLENGER].users == 0


def test_variants_are_counted_inside_their_arm_and_reported_as_its_mix(
    store: Engine, aliases: Registry, experiment: RunningExperiment
) -> None:
    """Variant choice is per request, inside the arm: the arm's numbers are the same whatever
    served them, and the mix says what did."""
    traffic(store, experiment.id, {CHAMPION: 0.5, CHALLENGER: 0.5}, users=300, errors={CHAMPION: 0.1},
            variants=("float32", "float32", "int8"))  # fmt: skip
    stats, mix = arm_stats(store, experiment.id, Rules().max_per_user), variant_mix(store, experiment.id)
    for arm in (CHAMPION, CHALLENGER):
        served = stats[arm].requests - stats[arm].errors
        assert sum(mix[arm].values()) == served and set(mix[arm]) == {"float32", "int8"}
        assert 0.2 < mix[arm]["int8"] / served < 0.45  # a third of the requests, split by arm
    assert stats[CHAMPION].errors > 0


def test_a_clearly_better_challenger_is_promoted(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    traffic(store, experiment.id, {CHAMPION: 0.3, CHALLENGER: 0.7}, users=600)
    evaluation = evaluate_once(store, aliases, tmp_path)
    assert evaluation.decision.outcome == "promote"
    assert aliases.resolve(MODEL, alias=CHAMPION).version == "2"
    assert not aliases.has_alias(MODEL, CHALLENGER)
    ended, looks = history(store, experiment.id)
    assert ended.status == "promoted" and ended.ended_at is not None
    assert [look.outcome for look in looks] == ["promote"]
    assert looks[0].challenger.rate > looks[0].champion.rate + 0.25 and looks[0].likelihood_ratio >= 20
    assert (
        evaluate_experiments(evaluate_job_of(settings(tmp_path)), store, aliases) == []
    )  # nothing left to test


def test_promoting_the_shared_model_pins_the_tenants_outside_it_to_what_they_were_served(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    """What the shared model learned from its tenants is never served to the others: before it
    moves, each tenant outside it without a champion of its own gets one, the version it was on; a
    tenant's own champion stays its own. A tenant's promotion moves its own aliases alone."""
    trains = {"acme": TRAINS_SHARED, "own": TRAINS_OWN, "off": TRAINS_NOTHING, "mine": TRAINS_OWN}
    tenants = {name: create_tenant(store, name, trains=how)[0] for name, how in trains.items()}
    mine, own = (Scope(name, tenants[name].id) for name in ("mine", "own"))
    aliases.set_alias(MODEL, mine.champion, "2")
    try:
        traffic(store, experiment.id, {CHAMPION: 0.3, CHALLENGER: 0.7}, users=600)
        assert evaluate_once(store, aliases, tmp_path).decision.outcome == "promote"
        off = tenant_alias(tenants["off"].id, CHAMPION)
        assert aliases.aliases(MODEL) == {CHAMPION: "2", own.champion: "1", off: "1", mine.champion: "2"}

        aliases.set_alias(MODEL, own.challenger, "2")
        assert promote(aliases, MODEL, "2", tmp_path, own) == "2"
        assert aliases.aliases(MODEL)[own.champion] == "2" and not aliases.has_alias(MODEL, own.challenger)
        assert aliases.aliases(MODEL)[CHAMPION] == "2"
    finally:  # the registry is the module's
        for alias in aliases.aliases(MODEL):
            if alias.startswith("tenant-"):
                aliases.delete_alias(MODEL, alias)


def test_a_clearly_worse_challenger_is_rolled_back(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    traffic(store, experiment.id, {CHAMPION: 0.7, CHALLENGER: 0.3}, users=600)
    evaluation = evaluate_once(store, aliases, tmp_path)
    assert evaluation.decision.outcome == "rollback"
    assert aliases.resolve(MODEL, alias=CHAMPION).version == "1" and not aliases.has_alias(MODEL, CHALLENGER)
    assert history(store, experiment.id)[0].status == "rolled_back"


def test_an_equal_challenger_keeps_going_until_the_longest_duration(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    traffic(store, experiment.id, {CHAMPION: 0.5, CHALLENGER: 0.5}, users=600)
    evaluation = evaluate_once(store, aliases, tmp_path)
    assert evaluation.decision.outcome == "continue"
    assert aliases.has_alias(MODEL, CHALLENGER) and running_experiment(store, MODEL) is not None
    with store.begin() as connection:  # two days later
        connection.execute(
            update(Experiment)
            .values(started_at=utcnow() - timedelta(days=2))
            .where(Experiment.id == experiment.id)
        )
    evaluation = evaluate_once(store, aliases, tmp_path)
    assert evaluation.decision.outcome == "expire" and "undecided after" in evaluation.decision.reason
    assert not aliases.has_alias(MODEL, CHALLENGER)
    ended, looks = history(store, experiment.id)
    assert ended.status == "expired" and [look.outcome for look in looks] == ["continue", "expire"]


def test_a_skewed_split_invalidates_the_experiment(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    traffic(store, experiment.id, {CHAMPION: 0.5, CHALLENGER: 0.9}, users=600, skew=0.3)
    evaluation = evaluate_once(store, aliases, tmp_path)
    assert evaluation.decision.outcome == "invalid" and evaluation.decision.srm_p < 0.001
    assert aliases.resolve(MODEL, alias=CHAMPION).version == "1" and not aliases.has_alias(MODEL, CHALLENGER)
    with Session(store) as session:
        recorded = session.scalars(select(ExperimentDecision)).one()
    assert recorded.outcome == "invalid" and recorded.champion["units"] > recorded.challenger["units"]


def test_fine_tuning_waits_while_an_experiment_runs(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    outcome = run_finetune(finetune_job_of(settings(tmp_path)), store, aliases, min_samples=0)
    assert outcome.status == "skipped" and f"experiment {experiment.id}" in outcome.message


def cli(tmp_path: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`reflow experiments ARGS` on the store at `url`."""
    env = {"REFLOW_DATABASE_URL": url, "REFLOW_DATA_DIR": str(tmp_path)}
    return reflow("experiments", *args, env=env, timeout_s=120)


def test_the_cli_lists_shows_and_plots_an_experiment(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    url = store.url.render_as_string(hide_password=False)
    for seed in range(3):  # three looks: two undecided, then the promotion
        traffic(store, experiment.id, {CHAMPION: 0.3, CHALLENGER: 0.7}, users=80, seed=seed)
        evaluate_experiments(evaluate_job_of(settings(tmp_path)), store, aliases)

    listed = cli(tmp_path, url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["id"], row["status"], row["champion_version"], row["challenger_version"]) == (
        experiment.id, "promoted", "1", "2",
    )  # fmt: skip
    assert row["latest"]["outcome"] == "promote" and row["latest"]["challenger"]["rated"] > 100
    shown = cli(tmp_path, url, "show", str(experiment.id))
    assert shown.returncode == 0 and "status\tpromoted" in shown.stdout
    assert shown.stdout.count("continue") == 2 and "promote" in shown.stdout
    mix = variant_mix(store, experiment.id)
    assert f"champion variants\tas loaded {mix[CHAMPION]['']}" in shown.stdout
    report = tmp_path / "report" / "experiment.png"
    plotted = cli(tmp_path, url, "report", str(experiment.id), "--out", str(report))
    assert plotted.returncode == 0, plotted.stderr
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and report.stat().st_size > 20_000
    missing = cli(tmp_path, url, "show", "99")
    assert missing.returncode == 1 and "no experiment 99" in missing.stderr


def test_a_decision_left_half_applied_is_finished_by_the_next_round(
    store: Engine, aliases: Registry, experiment: RunningExperiment, tmp_path: Path
) -> None:
    traffic(store, experiment.id, {CHAMPION: 0.3, CHALLENGER: 0.7}, users=600)
    stats = arm_stats(store, experiment.id, Rules().max_per_user)
    decision = decide(stats[CHAMPION], stats[CHALLENGER], evaluate_job_of(settings(tmp_path)).rules)
    assert record(store, experiment.id, stats, decision)  # then the process died: no alias moved
    assert not record(store, experiment.id, stats, decision)  # a second evaluator cannot act on it
    assert aliases.resolve(MODEL, alias=CHAMPION).version == "1"
    assert history(store, experiment.id)[0].status == "deciding"

    assert evaluate_experiments(evaluate_job_of(settings(tmp_path)), store, aliases) == []
    assert aliases.resolve(MODEL, alias=CHAMPION).version == "2" and not aliases.has_alias(MODEL, CHALLENGER)
    ended, looks = history(store, experiment.id)
    assert ended.status == "promoted" and [look.outcome for look in looks] == ["promote"]
