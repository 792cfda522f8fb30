"""The A/B decision rule on synthetic streams: clear winners and losers, ties, skewed splits,
guardrails, and an error rate that stays below alpha however often the experiment is looked at."""

from __future__ import annotations

import numpy as np

from feedback.experiments.decision import ArmStats, Rules, decide, likelihood_ratio, sample_ratio_p

RULES = Rules(alpha=0.05, min_samples=100, traffic=0.5)


def stream(rate: float, n: int, rng: np.random.Generator, requests: int | None = None) -> ArmStats:
    positive = int(rng.binomial(1, rate, n).sum())
    return ArmStats(rated=n, positive=positive, requests=requests or n)


def test_a_clearly_better_challenger_is_promoted() -> None:
    rng = np.random.default_rng(1)
    decision = decide(stream(0.30, 400, rng), stream(0.65, 400, rng), RULES)
    assert decision.outcome == "promote" and decision.difference > 0.2
    assert decision.likelihood_ratio >= 20 and "better" in decision.reason


def test_a_clearly_worse_challenger_is_rolled_back() -> None:
    rng = np.random.default_rng(2)
    decision = decide(stream(0.65, 400, rng), stream(0.30, 400, rng), RULES)
    assert decision.outcome == "rollback" and "worse" in decision.reason


def test_an_equal_challenger_keeps_the_experiment_going() -> None:
    rng = np.random.default_rng(3)
    decision = decide(stream(0.5, 2000, rng), stream(0.5, 2000, rng), RULES)
    assert decision.outcome == "continue" and decision.likelihood_ratio < 20


def test_too_few_samples_decide_nothing() -> None:
    decision = decide(ArmStats(50, 10), ArmStats(50, 45), RULES)
    assert decision.outcome == "continue" and "waiting for 100" in decision.reason


def test_a_skewed_split_is_a_sample_ratio_mismatch() -> None:
    rng = np.random.default_rng(4)
    decision = decide(stream(0.3, 700, rng), stream(0.7, 300, rng), RULES)  # 70/30 where 50/50 was set
    assert decision.outcome == "invalid" and decision.srm_p < 0.001
    assert sample_ratio_p(900, 100, traffic=0.1) > 0.5  # the configured 10% share is fine
    assert sample_ratio_p(500, 500, traffic=0.1) < 1e-6


def test_guardrails_roll_back_a_failing_or_slow_challenger() -> None:
    champion = ArmStats(rated=300, positive=150, requests=300, errors=0, p95_latency_ms=40)
    erring = ArmStats(rated=300, positive=280, requests=300, errors=30, p95_latency_ms=40)
    slow = ArmStats(rated=300, positive=280, requests=300, errors=0, p95_latency_ms=90)
    assert decide(champion, erring, RULES).reason.startswith("guardrail: error rate")
    assert decide(champion, slow, RULES).reason.startswith("guardrail: p95 latency")


def test_looking_after_every_rating_keeps_false_promotions_below_alpha() -> None:
    """A/A experiments (both arms 30% positive) checked after every pair of ratings, up to 2,000
    per arm: the share that ever stop stays below alpha, where a fixed-sample z-test peeked at
    the same way stops far more often."""
    rng = np.random.default_rng(5)
    runs, looks = 400, 2000
    a = rng.binomial(1, 0.3, (runs, looks)).cumsum(axis=1)
    b = rng.binomial(1, 0.3, (runs, looks)).cumsum(axis=1)
    stopped = naive = 0
    for run in range(runs):
        ever = ever_naive = False
        for n in range(RULES.min_samples, looks, 10):
            champion, challenger = ArmStats(n, int(a[run, n - 1])), ArmStats(n, int(b[run, n - 1]))
            ratio, theta = likelihood_ratio(champion, challenger)
            ever = ever or ratio >= 1 / RULES.alpha
            pooled = (champion.positive + challenger.positive) / (2 * n)
            z = theta / np.sqrt(max(pooled * (1 - pooled) * 2 / n, 1e-12))
            ever_naive = ever_naive or abs(z) > 1.96
        stopped += ever
        naive += ever_naive
    print(f"A/A experiments ever stopped: mSPRT {stopped / runs:.1%}, peeking z-test {naive / runs:.1%}")
    assert stopped / runs <= RULES.alpha
    assert naive / runs > 2 * RULES.alpha  # what the sequential test protects against


def test_busy_users_do_not_make_an_equal_challenger_stop() -> None:
    """A/A experiments, 400 users per arm, where the busiest 5% send 80% of the ratings and each
    user likes answers at a rate of their own (Beta(1, 2), mean 1/3: one user's ratings are alike),
    looked at 30 times as the ratings come in: with users as the unit the share that ever stops
    stays below alpha (about 1%), where counting each response as independent, as the test did
    before, stops in about half of them."""
    rng = np.random.default_rng(7)
    runs, users, looks = 500, 400, 30
    busy = users // 20
    stopped = naive = 0
    for _ in range(runs):
        arms = []
        for _arm in (0, 1):
            ratings = np.concatenate((rng.poisson(120, busy), 1 + rng.poisson(0.6, users - busy)))
            rated = rng.multinomial(ratings, np.full(looks, 1 / looks))  # (users, looks)
            liked = rng.binomial(rated, rng.beta(1, 2, users)[:, None])
            arms.append((rated.cumsum(axis=1), liked.cumsum(axis=1)))
        ever = ever_naive = False
        for look in range(looks):
            champion, challenger = (
                ArmStats(0, 0).with_ratings(np.stack((n[:, look], k[:, look]), axis=1), RULES.max_per_user)
                for n, k in arms
            )
            if min(champion.rated, challenger.rated) < RULES.min_samples:
                continue
            ever = ever or likelihood_ratio(champion, challenger)[0] >= 1 / RULES.alpha
            # the same numbers without the per-user ones: responses as the unit
            responses = (ArmStats(arm.rated, arm.positive) for arm in (champion, challenger))
            ever_naive = ever_naive or likelihood_ratio(*responses)[0] >= 1 / RULES.alpha
        stopped += ever
        naive += ever_naive
    print(f"A/A experiments ever stopped: users as unit {stopped / runs:.1%}, responses {naive / runs:.1%}")
    assert stopped / runs <= RULES.alpha
    assert naive / runs > 4 * RULES.alpha  # what counting users protects against


def test_a_correct_split_looked_at_again_and_again_is_rarely_flagged() -> None:
    """The sample ratio check runs at every evaluation, so its 0.1% per look adds up: correctly
    split experiments, looked at every 20 units up to 3,000, are flagged in a few percent."""
    rng = np.random.default_rng(6)
    runs, units = 2000, 3000
    for traffic in (0.1, 0.5):
        challenger = (rng.random((runs, units)) < traffic).cumsum(axis=1)
        flagged = 0
        for run in range(runs):
            for n in range(20, units + 1, 20):
                c = int(challenger[run, n - 1])
                rules = Rules(traffic=traffic)
                if decide(ArmStats(0, 0, units=n - c), ArmStats(0, 0, units=c), rules).outcome == "invalid":
                    flagged += 1
                    break
        print(f"correct {traffic:.0%} splits flagged as mismatched: {flagged / runs:.1%}")
        assert flagged / runs < 0.03


def test_a_challenger_failing_everything_is_rolled_back_though_nothing_gets_rated() -> None:
    champion = ArmStats(rated=150, positive=75, requests=150, units=150)
    failing = ArmStats(rated=0, positive=0, requests=150, errors=150, units=150)
    decision = decide(champion, failing, RULES)
    assert decision.outcome == "rollback" and decision.reason.startswith("guardrail: error rate 100.0%")


def test_a_small_split_is_not_judged_yet() -> None:
    assert (
        decide(ArmStats(0, 0, units=30), ArmStats(0, 0, units=0), RULES).outcome == "continue"
    )  # expects 15
    assert decide(ArmStats(0, 0, units=90), ArmStats(0, 0, units=10), RULES).outcome == "invalid"
