"""The gate with no task and no answer key, on thumbs alone: users rate sampled answers by a taste of
their own (a cheerful "!", tests/support/cheerful.py: the job never sees why), a tenth of them the
wrong way round. A candidate trained on their ratings turned upside down is refused by the held-out
users' honest ones, with its numbers in MLflow. (One trained on their ratings as they are is
registered, promoted, and liked more: the loop on thumbs, tests/test_loop.py; the gate's refusal
of one that moved too far on general prompts: test_lora_finetune.py.)"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from feedback.events import FeedbackEvent, InferenceEvent
from feedback.intake.consumer import store_events
from feedback.job_scheduler import finetune_job_of
from feedback.tasks.simulate import Behaviour, rated_offline
from feedback.training.dataset import is_held_out
from feedback.training.job import run_finetune
from reflow.registry import CHALLENGER, IMPORTED, SOURCE_TAG, Registry
from reflow.settings import Settings
from tests.support.cheerful import Cheerful
from tests.support.models import MODEL, arith_general_prompts, save_as_llama
from tests.support.registry import settings_with_champion
from tests.support.store import migrated_store
from workers.models.builtin import TOKENIZER
from workers.models.interface import CausalLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the cheerful model is trained first, once per run
USERS = 50
NOISY_USERS = Behaviour(thumbs_only=True, temperature=1.0, flip=0.1)
# an adapter over a tiny model takes a higher rate and more steps than LORA_RECIPE's (sized for SmolLM2)
LORA = {"finetune_steps": 200, "finetune_batch_size": 16, "finetune_lr": 1e-2}
# The rule this test is about is the ranking's. The gate checks drift on general prompts first, and a
# candidate trained on inverted ratings made the champion's answers there 0.080 nats/token less likely
# in one run and 0.113 in another whose training differed only in how its sums were rounded (the
# limit is 0.1): the drift limits are lifted here, and test_lora_finetune.py holds a candidate to them.
UNLIMITED_DRIFT = {"finetune_max_regression_kl": 100.0, "finetune_max_regression_nll_increase": 100.0}


@pytest.fixture
def settings(tmp_path: Path, cheerful_model: CausalLM) -> Settings:
    """The cheerful model as a Llama checkpoint, arith v1 @champion, and no task: what the job learns
    from is what users rated."""
    base = save_as_llama(cheerful_model, tmp_path / "llama")  # type: ignore[arg-type]
    general = str(arith_general_prompts(tmp_path / "general.txt"))
    return settings_with_champion(
        tmp_path,
        MODEL,
        base,
        {SOURCE_TAG: IMPORTED},
        finetune_min_samples=1,
        general_prompts_file=general,
        **LORA,
        **UNLIMITED_DRIFT,
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[Engine]:
    yield from migrated_store(settings.resolved_database_url)


def thumbs(model: CausalLM, n: int, seed: int) -> list[InferenceEvent | FeedbackEvent]:
    """`n` sampled answers to live traffic's sums, rated thumbs up or down by USERS noisy users."""
    prompts = Cheerful().traffic_prompts(n, random.Random(seed))
    return rated_offline(
        model, TOKENIZER, Cheerful(), prompts, tenant="acme", behaviour=NOISY_USERS, users=USERS, seed=seed
    )


def test_the_gate_refuses_a_candidate_trained_on_ratings_turned_upside_down(
    settings: Settings, store: Engine, cheerful_model: CausalLM
) -> None:
    fraction = settings.finetune_holdout_fraction
    upside_down = [  # the users trained on say the opposite; the held-out users stay honest
        e.model_copy(update={"rating": -e.rating})
        if isinstance(e, FeedbackEvent) and not is_held_out(e.user_id, fraction) else e
        for e in thumbs(cheerful_model, 300, seed=2)
    ]  # fmt: skip
    with store.begin() as connection:
        store_events(connection, upside_down)
    registry = Registry.from_settings(settings)

    outcome = run_finetune(finetune_job_of(settings), store, registry)

    assert outcome.status == "rejected", outcome.message
    assert "no better than chance" in outcome.message, outcome.message
    metrics = outcome.metrics or {}
    assert metrics["candidate_reward_auc"] < 0.5  # it prefers what the held-out users disliked
    assert not registry.has_alias(MODEL, CHALLENGER)
    run = registry.client.search_runs([registry.experiment_id()])[0]
    assert run.data.tags["reflow.verdict"] == outcome.message
    assert run.data.metrics["candidate_reward_auc"] == pytest.approx(metrics["candidate_reward_auc"])
    assert run.data.params["task"] == "none"
