"""The gate's rules on the numbers it measured: the reward AUC by hand, and each reason to refuse in
the order a reader of the verdict needs it."""

from __future__ import annotations

import math

import pytest

from feedback.training.gate import Limits, judge, reward_auc

PASSING = {  # a candidate the gate registers: numbers as feedback_shift and regression_shift give them
    "held_out_wanted": 20.0, "held_out_unwanted": 30.0, "reward_auc": 0.8, "reward_auc_lower": 0.7,
    "wanted_logp_gain": 0.1, "unwanted_logp_gain": -0.2, "regression_kl": 0.1, "regression_nll": 1.0,
    "regression_nll_champion": 1.0,
}  # fmt: skip


def test_reward_auc_counts_pairs_and_ties_by_hand() -> None:
    auc, error = reward_auc([3.0, 2.0], [1.0, 2.0])  # 3>1, 3>2, 2>1, 2=2 (a half): 3.5 of 4
    assert auc == 0.875
    q1, q2 = 0.875 / 1.125, 2 * 0.875**2 / 1.875
    by_hand = (0.875 * 0.125 + (q1 - 0.875**2) + (q2 - 0.875**2)) / 4  # Hanley and McNeil, n1 = n2 = 2
    assert math.isclose(error, math.sqrt(by_hand))
    assert reward_auc([0.0, 0.0], [0.0])[0] == 0.5  # a candidate that moved nothing ranks by chance


@pytest.mark.parametrize(
    ("changed", "reason"),
    [
        ({"held_out_unwanted": 4.0}, "has 20 wanted and 4 unwanted completions; the gate needs 5 of each"),
        ({"regression_kl": 0.6}, "on the general prompts the candidate moved 0.600 nats/token (KL)"),
        ({"regression_nll": 1.2}, "champion's own answers became 0.200 nats/token less likely"),
        ({"reward_auc": 0.6, "reward_auc_lower": 0.52}, "no better than chance by 0.05 (AUC 0.60, 95% lower"),
        ({"wanted_logp_gain": -0.01}, "users wanted did not become more likely (-0.010 nats/token)"),
        (
            {"unwanted_logp_gain": 0.1},
            "did not want became as much more likely as those they wanted (+0.100 ",
        ),
        ({"reward_auc_lower": math.nan}, "no better than chance"),  # no unwanted at all to rank against
    ],
)
def test_each_reason_to_refuse_is_given_in_a_sentence_with_its_numbers(changed: dict, reason: str) -> None:
    verdict = judge({}, PASSING | changed, Limits())
    assert not verdict.register and reason in verdict.reason, verdict.reason


def test_a_candidate_that_ranks_as_users_did_is_registered_with_its_numbers() -> None:
    verdict = judge({}, PASSING, Limits())
    assert verdict.register, verdict.reason
    assert judge(
        {}, PASSING | {"unwanted_logp_gain": 0.05}, Limits()
    ).register  # surer of everything, more so of the wanted
    assert verdict.reason.startswith("held-out feedback ranked at AUC 0.80, 95% lower bound 0.70")
    # a demo task's answer key, where there is one, must agree too
    answered = {"held_out_accuracy": 0.5, "held_out_items": 10.0}
    assert not judge({"held_out_accuracy": 0.5}, PASSING | answered, Limits()).register
