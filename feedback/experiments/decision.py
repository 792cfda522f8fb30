"""The A/B decision: an always-valid sequential test on per-arm positive-feedback rates, a sample
ratio mismatch check, and guardrails.

The test is the mixture sequential probability ratio test (mSPRT) of Johari, Pekelis and Walsh
("Always Valid Inference", 2017) on the difference of two proportions, with a normal mixing
distribution N(0, tau^2) over the effect. With theta the observed difference (challenger minus
champion) and V its estimated variance, the likelihood ratio against "no difference" is

    Lambda = sqrt(V / (V + tau^2)) * exp(tau^2 * theta^2 / (2 V (V + tau^2)))

and the experiment may stop the first time Lambda >= 1/alpha, however often it was looked at
before: the chance of ever stopping when the arms are equal stays below alpha.

Users, not responses, are the unit: what was randomized is the user, and one user's ratings are
alike (a user who likes the model likes most of its answers), so counting each response as an
independent draw understates the variance and a few busy users can make noise look like an
effect. A unit (a user of a tenant, or a request without one) with n rated responses, k of them
positive, has the mean k/n and the weight w = min(n, max_per_user); an arm's rate is
sum(w * mean) / sum(w), and V is the cluster-robust (sandwich) variance of the difference of the
two rates, pooled under "no difference": with p the pooled rate over both arms,

    V_arm = sum(w^2 * (mean - p)^2) / (sum w)^2,    V = V_champion + V_challenger

which, with one rating per user, is about the binomial p (1 - p) (1/n_champion + 1/n_challenger).
Decisions recorded before users were the unit carry no per-user numbers: theirs is that binomial
variance, responses as the unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

MIXING_SD = 0.1  # tau: the size of effect on a rate the test is most sensitive to
SRM_P = 0.001  # a split this unlikely under the configured traffic share invalidates the test
SRM_MIN_EXPECTED = 20  # units the smaller arm should have before the split is judged


@dataclass(frozen=True)
class ArmStats:
    """What one arm saw: rated responses, positive ones, requests, failed ones, assignment units
    (distinct users, or requests without one), latency; and its ratings by unit, weighted, with
    the sums the cluster-robust variance needs (0 in decisions recorded before users were the
    unit, which JSON rows load without)."""

    rated: int
    positive: int
    requests: int = 0
    errors: int = 0
    units: int = 0
    p95_latency_ms: float = 0.0
    users: int = 0  # units with a rated response
    weight: int = 0  # sum of w, a unit's weight min(rated, max_per_user)
    weighted_positive: float = 0.0  # sum of w * mean, a unit's mean its positive share
    weight_sq: int = 0  # sum of w^2
    weight_sq_mean: float = 0.0  # sum of w^2 * mean
    weight_sq_mean_sq: float = 0.0  # sum of w^2 * mean^2

    @property
    def rate(self) -> float:
        """The positive share: weighted by unit when known, else of responses."""
        if self.weight:
            return self.weighted_positive / self.weight
        return self.positive / self.rated if self.rated else 0.0

    def variance(self, around: float) -> float:
        """The cluster-robust variance of the weighted rate, the units' means taken around
        `around`: sum(w^2 (mean - around)^2) / (sum w)^2; needs `users`."""
        spread = self.weight_sq_mean_sq - 2 * around * self.weight_sq_mean + around * around * self.weight_sq
        return spread / (self.weight * self.weight)

    def with_ratings(self, per_unit: npt.ArrayLike, max_per_user: int) -> ArmStats:
        """These numbers with the arm's ratings: `per_unit` holds each unit's (rated, positive);
        a unit weighs at most `max_per_user` responses."""
        counts = np.asarray(per_unit, dtype=float).reshape(-1, 2)
        counts = counts[counts[:, 0] > 0]
        rated, positive = counts[:, 0], counts[:, 1]
        weight, mean = np.minimum(rated, max_per_user), positive / rated
        weight_sq = weight * weight
        return replace(
            self, rated=int(rated.sum()), positive=int(positive.sum()), users=len(counts),
            weight=int(weight.sum()), weighted_positive=float(weight @ mean), weight_sq=int(weight_sq.sum()),
            weight_sq_mean=float(weight_sq @ mean), weight_sq_mean_sq=float(weight_sq @ (mean * mean)),
        )  # fmt: skip

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class Decision:
    """promote, rollback, continue, invalid (sample ratio mismatch) or expire (undecided for too
    long), with the numbers behind it."""

    outcome: str
    reason: str
    likelihood_ratio: float = 1.0
    difference: float = 0.0
    srm_p: float = 1.0


@dataclass(frozen=True)
class Rules:
    """The experiment's settings."""

    alpha: float = 0.05
    min_samples: int = 100  # rated responses per arm before any decision
    traffic: float = 0.1  # share of assignments that go to the challenger
    max_error_rate_increase: float = 0.02  # guardrail: challenger errors minus champion's
    max_latency_ratio: float = 1.5  # guardrail: challenger p95 over champion's
    max_duration_s: float = float("inf")  # an experiment still undecided after this long expires
    max_per_user: int = 5  # the most rated responses one user weighs in an arm's rate


def likelihood_ratio(champion: ArmStats, challenger: ArmStats, tau: float = MIXING_SD) -> tuple[float, float]:
    """The mSPRT statistic and the observed difference of rates (challenger - champion)."""
    theta = challenger.rate - champion.rate
    # the variance of the difference under "no difference" (pooled): larger, so more cautious,
    # than the unpooled one when the rates differ
    if champion.users and challenger.users:
        pooled = (champion.weighted_positive + challenger.weighted_positive) / (
            champion.weight + challenger.weight
        )
        variance = champion.variance(pooled) + challenger.variance(pooled)
    else:  # recorded before users were the unit: responses are
        pooled = (champion.positive + challenger.positive) / (champion.rated + challenger.rated)
        variance = pooled * (1 - pooled) * (1 / champion.rated + 1 / challenger.rated)
    if variance <= 0:  # every rating the same on both arms: no evidence of a difference
        return 1.0, theta
    t2 = tau * tau
    log_ratio = 0.5 * math.log(variance / (variance + t2)) + t2 * theta * theta / (
        2 * variance * (variance + t2)
    )
    return math.exp(min(log_ratio, 700.0)), theta


def sample_ratio_p(champion_n: int, challenger_n: int, traffic: float) -> float:
    """p-value of a chi-square test (1 degree of freedom) that the split follows `traffic`."""
    total = champion_n + challenger_n
    if total == 0:
        return 1.0
    expected = (total * (1 - traffic), total * traffic)
    chi2 = sum((o - e) ** 2 / e for o, e in zip((champion_n, challenger_n), expected, strict=True) if e > 0)
    return math.erfc(math.sqrt(chi2 / 2))  # the chi-square(1) survival function


def decide(champion: ArmStats, challenger: ArmStats, rules: Rules, elapsed_s: float = 0.0) -> Decision:
    """What to do now with an experiment, `elapsed_s` old, whose arms saw `champion` and
    `challenger`: the test's verdict, or `expire` when it is still undecided after the longest
    duration the rules allow."""
    decision = _verdict(champion, challenger, rules)
    if decision.outcome == "continue" and elapsed_s > rules.max_duration_s:
        return replace(
            decision, outcome="expire", reason=f"undecided after {elapsed_s:.0f}s; {decision.reason}"
        )
    return decision


def _verdict(champion: ArmStats, challenger: ArmStats, rules: Rules) -> Decision:
    """The sample ratio check, the guardrails and the sequential test, in that order.

    The split is checked on assignment units when they are known (users are what was randomized;
    the requests of one user are not independent draws), else on requests, else on ratings, once
    each arm expects SRM_MIN_EXPECTED of them (the chi-square approximation is poor below). The
    guardrails need `min_samples` requests per arm, not ratings: a failed request is rarely rated,
    so a challenger that fails everything would otherwise wait forever.
    """
    units = _units(champion), _units(challenger)
    srm = sample_ratio_p(*units, rules.traffic)
    expected = sum(units) * min(rules.traffic, 1 - rules.traffic)
    if expected >= SRM_MIN_EXPECTED and srm < SRM_P:
        return Decision(
            "invalid", f"sample ratio mismatch (p={srm:.2g}): the split is not the configured one", srm_p=srm
        )
    tripped = _guardrail(champion, challenger, rules)
    if tripped and min(champion.requests, challenger.requests) >= rules.min_samples:
        return Decision("rollback", f"guardrail: {tripped}", srm_p=srm)
    if min(champion.rated, challenger.rated) < rules.min_samples:
        return Decision("continue", f"waiting for {rules.min_samples} rated responses per arm", srm_p=srm)
    ratio, theta = likelihood_ratio(champion, challenger)
    numbers = (
        f"rates {champion.rate:.1%} vs {challenger.rate:.1%}, "
        f"likelihood ratio {ratio:.3g} (stop at {1 / rules.alpha:.3g})"
    )
    if ratio < 1 / rules.alpha:
        return Decision("continue", f"no decision yet: {numbers}", ratio, theta, srm)
    outcome = "promote" if theta > 0 else "rollback"
    return Decision(
        outcome, f"challenger is {'better' if theta > 0 else 'worse'}: {numbers}", ratio, theta, srm
    )


def _units(arm: ArmStats) -> int:
    return arm.units or arm.requests or arm.rated


def _guardrail(champion: ArmStats, challenger: ArmStats, rules: Rules) -> str:
    """What the challenger does worse than the guardrails allow; empty when nothing."""
    if challenger.error_rate - champion.error_rate > rules.max_error_rate_increase:
        return f"error rate {challenger.error_rate:.1%} vs {champion.error_rate:.1%}"
    if (
        champion.p95_latency_ms
        and challenger.p95_latency_ms > rules.max_latency_ratio * champion.p95_latency_ms
    ):
        return f"p95 latency {challenger.p95_latency_ms:.0f} ms vs {champion.p95_latency_ms:.0f} ms"
    return ""
