"""The whole learning loop, with no human step: the scheduler fine-tunes a challenger from users'
feedback, the experiment promotes it, every worker serves it, and no request fails on the way. As a
newcomer runs it, `reflow up --demo` on the built-in model (a full fine-tune from corrections over a
range the base model mostly gets wrong); and as a deployment without an answer key runs it, `reflow
up` on a Llama checkpoint whose users only click thumbs, some the wrong way round (a LoRA adapter,
merged when promoted)."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from feedback.experiments.lifecycle import experiments
from feedback.tasks import get_task
from feedback.tasks.simulate import Behaviour
from feedback.training.evaluation import base_model_metrics
from reflow.client import Client
from reflow.registry import BASE_VERSION_TAG, IMPORTED, SOURCE_TAG, Registry
from reflow.store.database import open_engine
from reflow.store.tables import FinetuneRun, aware
from tests.support.cheerful import Cheerful
from tests.support.models import MODEL, arith_general_prompts, save_as_llama, save_model
from tests.support.registry import new_store
from tests.support.up import API_KEY, Up
from tests.support.users import Users
from tests.support.waiting import wait_for
from workers.models.interface import CausalLM
from workers.models.loader import load_checkpoint

pytestmark = pytest.mark.slow
LOOP_TIMEOUT_S = 600  # a generous ceiling: a turn takes about 2 minutes alone here, 3 in the suite
FAST_LOOP = {  # on top of --demo's schedule: fine-tune as soon as enough feedback is in
    "REFLOW_FINETUNE_INTERVAL_S": "5",
    "REFLOW_FINETUNE_MIN_SAMPLES": "300",
    "REFLOW_AB_MIN_SAMPLES": "50",
    "REFLOW_AB_EVALUATE_S": "3",
}
SKIPPED = "maximum number of running instances"  # APScheduler's line every interval while a job runs


@pytest.mark.timeout(LOOP_TIMEOUT_S + 300)  # the turn, and reflow up's start and stop around it
def test_the_loop_turns_by_itself_and_the_champion_gets_better(tmp_path: Path, base_model: CausalLM) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    registry = Registry(f"sqlite:///{new_store(data_dir / 'mlflow.db')}", (data_dir / "mlartifacts").as_uri())
    registry.register(
        MODEL, save_model(base_model, tmp_path / "base"), params={}, metrics={}, alias="champion"
    )
    champion, turned_s = turn_the_loop(Up(data_dir, "--workers", "1", "--demo", env=FAST_LOOP), registry)

    store = open_engine(f"sqlite:///{data_dir / 'reflow.db'}")
    (experiment, look), *_ = experiments(store)
    with Session(store) as session:
        run = session.scalars(select(FinetuneRun).where(FinetuneRun.version == champion)).one()
    store.dispose()
    assert (experiment.status, experiment.challenger_version) == ("promoted", champion)
    assert look is not None and look.outcome == "promote" and look.challenger.rate > look.champion.rate
    # what the run logged and registered: tests/feedback/training/test_finetune.py
    assert registry.client.get_model_version(MODEL, champion).tags["reflow.parent_version"] == "1"
    assert run.status == "registered" and run.samples >= 300
    promoted, tokenizer = load_checkpoint(
        registry.download(registry.resolve(MODEL, version=champion), tmp_path / "cache")
    )
    before = base_model_metrics(base_model, tokenizer, get_task("arith"))
    after = base_model_metrics(promoted, tokenizer, get_task("arith"))
    assert after["accuracy_wide_range"] - before["accuracy_wide_range"] >= 0.20, (before, after)
    assert before["accuracy_in_range"] - after["accuracy_in_range"] <= 0.02, (before, after)
    finetune_s = (aware(run.finished_at) - aware(run.started_at)).total_seconds()
    experiment_s = (aware(experiment.ended_at) - aware(experiment.started_at)).total_seconds()
    print(f"fine-tune job {finetune_s:.0f}s, experiment {experiment_s:.0f}s")
    print(f"loop turned in {turned_s:.0f}s: wide-range accuracy {before['accuracy_wide_range']:.1%} -> "
          f"{after['accuracy_wide_range']:.1%}")  # fmt: skip


@pytest.mark.timeout(LOOP_TIMEOUT_S + 300)
def test_the_loop_turns_on_noisy_thumbs_alone_with_a_lora_adapter_served_beside_the_champion(
    tmp_path: Path, cheerful_model: CausalLM
) -> None:
    """No task and no answer key: `reflow up` (not the demo) on a Llama-family checkpoint whose users,
    simulated here, sample its answers and only click thumbs, by a taste of their own (a cheerful
    "!", tests/support/cheerful.py), a tenth of them the wrong way round. The job trains an adapter
    on their ratings, the gate passes it on held-out users, the worker serves it over the champion's
    weights in the same batches, the experiment promotes it on the users' ratings, the promotion
    merges it into a new full version, every worker serves that, and the users like its answers
    more often."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    registry = Registry(f"sqlite:///{new_store(data_dir / 'mlflow.db')}", (data_dir / "mlartifacts").as_uri())
    checkpoint = save_as_llama(cheerful_model, tmp_path / "llama")  # type: ignore[arg-type]
    registry.register(MODEL, checkpoint, params={}, metrics={}, alias="champion", tags={SOURCE_TAG: IMPORTED})
    general = arith_general_prompts(tmp_path / "general.txt")  # its world is sums, not chat
    thumbs = {  # the demo's split, and the adapter recipe of tests/feedback/training/test_thumbs.py
        "REFLOW_AB_TRAFFIC": "0.5", "REFLOW_GENERAL_PROMPTS_FILE": str(general),
        "REFLOW_FINETUNE_STEPS": "200", "REFLOW_FINETUNE_BATCH_SIZE": "16", "REFLOW_FINETUNE_LR": "1e-2",
    }  # fmt: skip
    users = Users(API_KEY, Cheerful(), Behaviour(thumbs_only=True, temperature=1.0, flip=0.1))
    champion, turned_s = turn_the_loop(
        Up(data_dir, "--workers", "1", env=FAST_LOOP | thumbs), registry, users
    )

    merged = registry.client.get_model_version(MODEL, champion)
    adapter = merged.tags["reflow.merged_from"]
    assert merged.tags["reflow.source"] == "merge" and merged.tags["reflow.parent_version"] == "1"
    assert registry.tags(registry.resolve(MODEL, version=adapter))[BASE_VERSION_TAG] == "1"
    store = open_engine(f"sqlite:///{data_dir / 'reflow.db'}")
    (experiment, look), *_ = experiments(store)
    with Session(store) as session:
        (run,) = session.scalars(select(FinetuneRun).where(FinetuneRun.version == adapter)).all()
    store.dispose()
    assert (experiment.status, experiment.challenger_version) == ("promoted", adapter)
    assert look is not None and look.challenger.rate > look.champion.rate
    assert (
        run.metrics["candidate_reward_auc"] > 0.5 and "champion_held_out_accuracy" not in run.metrics
    )  # no oracle
    artifacts = {a.path for a in registry.client.list_artifacts(run.mlflow_run_id, "model")}
    assert {"model/adapter_config.json", "model/adapter_model.safetensors"} <= artifacts
    assert "model/model.safetensors" not in artifacts  # an adapter is megabytes, not a model
    (liked_before, asked_before), (liked_after, asked_after) = (
        users.report.by_version[v] for v in ("1", adapter)
    )
    before, after = liked_before / asked_before, liked_after / asked_after  # what users saw, before any flip
    assert after > before + 0.1, users.report.by_version
    print(f"loop turned in {turned_s:.0f}s on thumbs: liked {before:.1%} ({asked_before} answers of v1) -> "
          f"{after:.1%} ({asked_after} of the adapter)")  # fmt: skip


def turn_the_loop(up: Up, registry: Registry, users: Users | None = None) -> tuple[str, float]:
    """Waits for `reflow up` to promote a new champion and for the worker to serve it, with no failed
    request on the way; returns the champion's version and how long the turn took. The traffic is
    `--demo`'s simulated users, or `users`, who ask from the moment it is up until the new champion
    is served."""
    try:
        endpoints = up.endpoints()
        started = time.monotonic()
        if users is not None:
            users.start(endpoints["gateway"])

        def promoted() -> str | None:
            assert up.process.poll() is None, up.output()
            version = registry.resolve(MODEL, alias="champion").version
            return version if version != "1" else None

        try:
            champion = wait_for(promoted, LOOP_TIMEOUT_S, what="a promotion", interval_s=2)
        except AssertionError as error:
            scheduler = up.log_tail("scheduler", unless=SKIPPED)
            raise AssertionError(f"{error}:\n{up.output()}\nthe scheduler's log ends:\n{scheduler}") from None
        turned_s = time.monotonic() - started

        with Client(endpoints["gateway"], API_KEY) as client:
            wait_for(
                lambda: _champion_served(client) == (champion, 1),
                15,
                what="the worker serving the new champion",
            )
        with urllib.request.urlopen(endpoints["metrics"]["gateway"], timeout=10) as reply:
            codes = re.findall(r'reflow_gateway_requests_total\{code="(\w+)",method="Generate"\} (\S+)',
                               reply.read().decode())  # fmt: skip
        assert {code for code, n in codes if float(n)} == {"OK"}, codes  # no failed request
        if users is not None:  # (stopped only now: they cancel what they still wait for)
            users.stop()
            assert not users.report.errors and not users.report.feedback_errors, users.report
    finally:
        if users is not None:
            users.stop()
        assert up.stop() == 0, up.output()
    return champion, turned_s


def _champion_served(client: Client) -> tuple[str, int] | None:
    """(version, ready workers) of the version the workers serve as champion."""
    for model in client.list_models().models:
        for version in model.versions:
            if "champion" in version.aliases:
                return version.version, version.ready_workers
    return None
