"""The fine-tune job with no task and no answer key, on thumbs alone: users rate sampled answers by
a taste of their own (a cheerful "!", tests/support/cheerful.py: the job never sees why), and a
tenth of their ratings are the wrong way round. A candidate trained on their ratings is registered
and its answers please them more often; one trained on ratings turned upside down is refused by the
held-out users' honest ones, with its numbers in MLflow. (The whole loop on thumbs, to a
promotion: tests/test_loop.py.)"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from sqlalchemy import Engine

from feedback.events import FeedbackEvent, InferenceEvent
from feedback.intake.consumer import store_events
from feedback.scheduler import finetune_job_of
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
from workers.models.greedy import completions
from workers.models.interface import CausalLM
from workers.models.loader import load_checkpoint
from workers.models.lora import AdaptedModel, Adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the cheerful model is trained first, once per run
USERS = 50
NOISY_USERS = Behaviour(thumbs_only=True, temperature=1.0, flip=0.1)
# an adapter over a tiny model takes a higher rate and more steps than LORA_RECIPE's (sized for SmolLM2)
LORA = {"finetune_steps": 200, "finetune_batch_size": 16, "finetune_lr": 1e-2}


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


def liked(model: CausalLM) -> float:
    """The share of sampled answers to fresh sums these users would like."""
    prompts = Cheerful().traffic_prompts(400, random.Random(99))
    answers = completions(
        model,
        TOKENIZER,
        prompts,
        temperature=NOISY_USERS.temperature,
        generator=torch.Generator().manual_seed(9),
    )
    return sum(Cheerful().is_correct(p, a) for p, (_, a) in zip(prompts, answers, strict=True)) / len(prompts)


def test_noisy_thumbs_alone_register_a_challenger_users_like_more(
    settings: Settings, store: Engine, cheerful_model: CausalLM
) -> None:
    with store.begin() as connection:
        store_events(connection, thumbs(cheerful_model, 400, seed=1))
    registry = Registry.from_settings(settings)

    outcome = run_finetune(finetune_job_of(settings), store, registry)

    assert outcome.status == "registered", outcome.message
    metrics = outcome.metrics or {}
    assert metrics["candidate_reward_auc_lower"] > 0.5 + settings.finetune_reward_margin
    assert metrics["candidate_wanted_logp_gain"] > metrics["candidate_unwanted_logp_gain"]
    assert not any("accuracy" in name for name in metrics)  # no task: no oracle anywhere in the job
    adapter = registry.download(registry.resolve(MODEL, alias=CHALLENGER), settings.data_dir / "cache")
    champion = load_checkpoint(
        registry.download(registry.resolve(MODEL, alias="champion"), settings.data_dir)
    )[0]
    challenger = AdaptedModel(champion, Adapter.load(adapter, torch.device("cpu"), torch.float32))  # type: ignore[arg-type]
    before, after = liked(champion), liked(challenger)
    print(f"liked {before:.1%} -> {after:.1%}; {outcome.message}")
    assert after > before + 0.1, (before, after)


def test_the_gate_refuses_a_candidate_trained_on_ratings_turned_upside_down(
    settings: Settings, store: Engine, cheerful_model: CausalLM
) -> None:
    fraction = settings.finetune_holdout_fraction
    upside_down = [  # the users trained on say the opposite; the held-out users stay honest
        e.model_copy(update={"rating": -e.rating})
        if isinstance(e, FeedbackEvent) and not is_held_out(e.user_id, fraction) else e
        for e in thumbs(cheerful_model, 400, seed=2)
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
