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
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from feedback.experiments.lifecycle import experiments
from feedback.tasks import get_task
from feedback.tasks.simulate import Behaviour
from feedback.training.evaluation import base_model_metrics
from gateway.tenants import create_tenant
from reflow.client import Client
from reflow.registry import BASE_VERSION_TAG, IMPORTED, SOURCE_TAG, TENANT_TAG, Registry
from reflow.scopes import Scope
from reflow.store.database import migrate, open_db
from reflow.store.tables import TRAINS_NOTHING, TRAINS_OWN, FeedbackItem, FinetuneRun, aware
from reflow.v1.inference_pb2 import SamplingParams
from tests.support.cheerful import Cheerful, Plain
from tests.support.models import MODEL, arith_general_prompts, save_as_llama, save_model
from tests.support.registry import new_store
from tests.support.up import API_KEY, Up
from tests.support.users import Users
from tests.support.waiting import wait_for
from workers.models.interface import CausalLM
from workers.models.loader import load_checkpoint

pytestmark = pytest.mark.slow
# A ceiling, not a wait: a turn takes about 2 minutes alone on an AVX-512 machine, 3 in the suite;
# on 2 cores of a 2 GHz AVX2 EPYC each of the tenants test's rounds trained for 110-140 s, and two
# rejected rounds before a promotion ran past 600 s.
LOOP_TIMEOUT_S = 900
FAST_LOOP = {  # on top of --demo's schedule: fine-tune as soon as enough feedback is in
    "REFLOW_FINETUNE_INTERVAL_S": "5",
    "REFLOW_FINETUNE_MIN_SAMPLES": "300",
    "REFLOW_AB_MIN_SAMPLES": "50",
    "REFLOW_AB_EVALUATE_S": "3",
    # the latency guardrail at 3x, not 1.5x: the p95 of 50 requests on 2 cores shared with the rest
    # of the suite rolled back a good challenger at 1.56x (tests/feedback/experiments covers the rule)
    "REFLOW_AB_MAX_LATENCY_RATIO": "3",
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

    store = open_db(f"sqlite:///{data_dir / 'reflow.db'}")
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
def test_tenants_of_opposite_taste_each_get_what_they_like_on_thumbs_alone_and_an_opted_out_one_the_champion(
    tmp_path: Path, cheerful_model: CausalLM
) -> None:
    """No task and no answer key: `reflow up` (not the demo) on a Llama-family checkpoint, three
    tenants whose users, simulated here, sample its answers and only click thumbs, a tenth of them
    the wrong way round. `reflow up`'s own tenant is in the shared model and its users like a
    cheerful "!" (tests/support/cheerful.py); tenant "plain" trains its own versions and its users
    like the opposite; tenant "off" trains nothing. For each of the two, the job trains an adapter
    on its own tenant's ratings alone, the gate passes it on held-out users, the worker serves it
    over the champion's weights in the same batches, an experiment on that tenant's users alone
    promotes it, and those users like its answers more often. The shared promotion merges its
    adapter into a new full version; plain's stays an adapter, served to plain alone; "off" is
    served the base's exact tokens throughout (pinned to it when the shared model moved)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    registry = Registry(f"sqlite:///{new_store(data_dir / 'mlflow.db')}", (data_dir / "mlartifacts").as_uri())
    checkpoint = save_as_llama(cheerful_model, tmp_path / "llama")  # type: ignore[arg-type]
    registry.register(MODEL, checkpoint, params={}, metrics={}, alias="champion", tags={SOURCE_TAG: IMPORTED})
    store = open_db(f"sqlite:///{data_dir / 'reflow.db'}")
    migrate(store)
    plain_tenant, plain_key = create_tenant(store, "plain", trains=TRAINS_OWN)
    _, off_key = create_tenant(store, "off", trains=TRAINS_NOTHING)
    plain = Scope("plain", plain_tenant.id)
    general = arith_general_prompts(tmp_path / "general.txt")  # its world is sums, not chat
    thumbs = {  # the demo's split, and the adapter recipe of tests/feedback/training/test_thumbs.py
        "REFLOW_AB_TRAFFIC": "0.5", "REFLOW_GENERAL_PROMPTS_FILE": str(general),
        "REFLOW_FINETUNE_STEPS": "200", "REFLOW_FINETUNE_BATCH_SIZE": "16", "REFLOW_FINETUNE_LR": "1e-2",
    }  # fmt: skip
    behaviour = Behaviour(thumbs_only=True, temperature=1.0, flip=0.1)
    users = Users(API_KEY, Cheerful(), behaviour)
    plain_users = Users(plain_key, Plain(), behaviour)
    up = Up(data_dir, "--workers", "1", env=FAST_LOOP | thumbs)
    asked = [f"{a}+{b}=" for a, b in ((3, 4), (12, 30), (45, 45))]
    off: dict[str, list[tuple[str, str]]] = {}  # what "off" was served, before and after

    def plain_promoted() -> bool:
        served = registry.aliases(MODEL).get(plain.champion)
        return served is not None and TENANT_TAG in registry.tags(registry.resolve(MODEL, version=served))

    champion, turned_s = turn_the_loop(
        up, registry, (users, plain_users), also_promoted=plain_promoted,
        around=lambda when, gateway: off.setdefault(when, _greedy(gateway, off_key, asked)),
    )  # fmt: skip

    merged = registry.client.get_model_version(MODEL, champion)
    adapter = merged.tags["reflow.merged_from"]
    assert merged.tags["reflow.source"] == "merge" and merged.tags["reflow.parent_version"] == "1"
    assert registry.tags(registry.resolve(MODEL, version=adapter))[BASE_VERSION_TAG] == "1"
    plain_adapter = registry.aliases(MODEL)[plain.champion]
    plain_tags = registry.tags(registry.resolve(MODEL, version=plain_adapter))
    assert (plain_tags[BASE_VERSION_TAG], plain_tags[TENANT_TAG]) == ("1", "plain")  # its alone, over v1
    with Session(store) as session:
        found = {(e.tenant, e.status, e.challenger_version) for e, _ in experiments(store)}
        runs = {
            run.tenant: run for run in session.scalars(select(FinetuneRun).where(FinetuneRun.version != ""))
        }
        used = select(FeedbackItem.tenant).distinct()
        trained_on = {
            t: set(session.scalars(used.where(FeedbackItem.finetune_run_id == r.id))) for t, r in runs.items()
        }
    store.dispose()
    assert {("", "promoted", adapter), ("plain", "promoted", plain_adapter)} <= found
    assert trained_on == {"": {"default"}, "plain": {"plain"}}  # each on its own tenant's feedback alone
    run = runs[""]  # the shared model's
    assert (
        run.metrics["candidate_reward_auc"] > 0.5 and "champion_held_out_accuracy" not in run.metrics
    )  # no oracle
    artifacts = {a.path for a in registry.client.list_artifacts(run.mlflow_run_id, "model")}
    assert {"model/adapter_config.json", "model/adapter_model.safetensors"} <= artifacts
    assert "model/model.safetensors" not in artifacts  # an adapter is megabytes, not a model
    for who, served in ((users, adapter), (plain_users, plain_adapter)):
        (liked_before, asked_before), (liked_after, asked_after) = (
            who.report.by_version[v] for v in ("1", served)
        )
        before, after = liked_before / asked_before, liked_after / asked_after  # seen, before any flip
        assert after > before + 0.1, who.report.by_version
        print(f"{type(who.task).__name__} users: liked {before:.1%} ({asked_before} answers of v1) -> "
              f"{after:.1%} ({asked_after} of v{served})")  # fmt: skip
    assert off["before"] == off["after"] and {version for version, _ in off["after"]} == {"1"}, off
    print(f"loop turned in {turned_s:.0f}s for both")


def _greedy(gateway: str, api_key: str, prompts: list[str]) -> list[tuple[str, str]]:
    """(version, text) of a greedy completion of each prompt, for the tenant holding `api_key`."""
    answers = []
    with Client(gateway, api_key) as client:
        for prompt in prompts:
            messages = list(client.generate(prompt, sampling=SamplingParams(max_tokens=8)))
            answers.append((messages[0].model_version, "".join(m.text for m in messages)))
    return answers


def turn_the_loop(
    up: Up,
    registry: Registry,
    users: Sequence[Users] = (),
    also_promoted: Callable[[], bool] | None = None,
    around: Callable[[str, str], object] | None = None,
) -> tuple[str, float]:
    """Waits for `reflow up` to promote a new champion (and `also_promoted`, a tenant's) and for the
    worker to serve it, with no failed request on the way; returns the champion's version and how
    long the turn took. The traffic is `--demo`'s simulated users, or `users`, who ask from the
    moment it is up until the new champion is served; `around("before" | "after", gateway)` runs
    before they start and once the promotions are served."""
    try:
        endpoints = up.endpoints()
        started = time.monotonic()
        if around is not None:
            around("before", endpoints["gateway"])
        for who in users:
            who.start(endpoints["gateway"])

        def promoted() -> str | None:
            assert up.process.poll() is None, up.output()
            version = registry.resolve(MODEL, alias="champion").version
            done = version != "1" and (also_promoted is None or also_promoted())
            return version if done else None

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
        if around is not None:
            around("after", endpoints["gateway"])
        with urllib.request.urlopen(endpoints["metrics"]["gateway"], timeout=10) as reply:
            codes = re.findall(r'reflow_gateway_requests_total\{code="(\w+)",method="Generate"\} (\S+)',
                               reply.read().decode())  # fmt: skip
        assert {code for code, n in codes if float(n)} == {"OK"}, codes  # no failed request
        for who in users:  # (stopped only now: they cancel what they still wait for)
            who.stop()
            assert not who.report.errors and not who.report.feedback_errors, who.report
    finally:
        for who in users:
            who.stop()
        assert up.stop() == 0, up.output()
    return champion, turned_s


def _champion_served(client: Client) -> tuple[str, int] | None:
    """(version, ready workers) of the version the workers serve as champion."""
    for model in client.list_models().models:
        for version in model.versions:
            if "champion" in version.aliases:
                return version.version, version.ready_workers
    return None
