"""The learning loop on thumbs alone, as a deployment without an answer key runs it, on
SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/thumbs_loop.py [--flips 0.1 0] [--rate 1.5] [--timeout 2700]
    .venv/bin/python benchmarks/thumbs_loop.py --tenants [--flips 0.1] [--rate 1.5] [--timeout 4200]

For each share of flipped ratings, in a fresh data directory: `reflow up --model GGUF --workers 1`
(no --demo, no REFLOW_TASK: the job sees ratings and nothing else), and simulated users sending
chat requests at temperature 0.9, `--rate` a second, who say what they think only by thumbs, that
share of them the wrong way round.

Without --tenants, the users are `reflow up`'s own tenant's (in the shared model) and like an answer
laid out as a numbered list (feedback/tasks/numbered.py). With --tenants, two tenants that train
their own versions send `--rate` each: "lists", whose users like a numbered list, and "prose",
whose users like the opposite; a third, "off", trains nothing and asks three fixed requests greedily
every minute, which must be answered with v1's exact tokens throughout.

Prints, per run and per tenant: the seconds from its first rating to its first registered
challenger and to its promotion; what its users saw, the share of answers they liked from the
champion and from the challenger; the share of the base and the promoted version's answers to 96
fresh requests, sampled offline at the same temperature and seed, they would like; each fine-tune
run's time and verdict; the latency of the completions served while a run trained beside them and
while none did (training and serving share the 2 cores: the job waits passively,
docs/benchmarks.md); and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hot_swap import percentile  # this script's directory is on sys.path
from sqlalchemy import select
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from feedback.tasks.numbered import Numbered
from feedback.tasks.simulate import Behaviour
from feedback.tasks.task import Task
from feedback.training.job import load_version
from gateway.tenants import create_tenant
from reflow.cli.models import name_of
from reflow.client import Client
from reflow.registry import CHAMPION, SOURCE_TAG, TENANT_TAG, Registry, VersionRef
from reflow.scopes import Scope
from reflow.store.database import migrate, open_db
from reflow.store.tables import (
    TRAINS_NOTHING,
    TRAINS_OWN,
    Experiment,
    FeedbackItem,
    FinetuneRun,
    Inference,
    aware,
)
from reflow.v1.inference_pb2 import ChatMessage, SamplingParams
from tests.support.smollm2 import smollm2_gguf
from tests.support.users import Users
from workers.models.greedy import completions
from workers.models.prompts import user_turn

API_KEY = "rf_bench_thumbs_0123456789"
TEMPERATURE = 0.9
LOOP = {  # the demo's schedule (docs/experiments.md), with no task and no simulated users of its own
    "REFLOW_FINETUNE_INTERVAL_S": "30", "REFLOW_FINETUNE_MIN_SAMPLES": "300", "REFLOW_AB_TRAFFIC": "0.5",
    "REFLOW_AB_EVALUATE_S": "10", "REFLOW_ISOLATION": "none", "REFLOW_API_KEY": API_KEY,
}  # fmt: skip


OFF_REQUESTS = (
    "Give me some tips for baking bread.",
    "Tell me about training a puppy.",
    "Any advice on cooking rice?",
)


@dataclass(frozen=True)
class Prose(Numbered):
    """The opposite taste: users who like an answer that is not laid out as a numbered list."""

    def is_correct(self, prompt: str, answer: str) -> bool:
        return not super().is_correct(prompt, answer)


@dataclass
class Cohort:
    """One tenant's simulated users: whose, what they like, and how a promotion of theirs is known."""

    tenant: str  # "" = `reflow up`'s own, in the shared model
    taste: Task
    users: Users
    promoted: Callable[[Registry, str], VersionRef | None]
    seen: list[str] = field(default_factory=list)


def liked_offline(registry: Registry, ref: VersionRef, cache: Path, taste: Task, n: int = 96) -> float:
    """The share of a version's sampled answers to `n` fresh requests users of `taste` would like."""
    model, tokenizer, _ = load_version(registry, ref, cache, torch.device("cpu"))
    prompts = taste.traffic_prompts(n, random.Random(99))
    answers = completions(
        model, tokenizer, [user_turn(p) for p in prompts], temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(9), batch_size=32,
    )  # fmt: skip
    return sum(taste.is_correct(p, a) for p, (_, a) in zip(prompts, answers, strict=True)) / n


def shared_promotion(registry: Registry, name: str) -> VersionRef | None:
    """The shared champion, once a promotion merged an adapter into it."""
    champion = registry.resolve(name, alias=CHAMPION)
    return champion if registry.tags(champion).get(SOURCE_TAG) == "merge" else None


def own_promotion(scope: Scope) -> Callable[[Registry, str], VersionRef | None]:
    """The tenant's own champion, once one of its own versions was promoted to it."""

    def promoted(registry: Registry, name: str) -> VersionRef | None:
        version = registry.aliases(name).get(scope.champion)
        if version is None:
            return None
        ref = registry.resolve(name, version=version)
        return ref if TENANT_TAG in registry.tags(ref) else None

    return promoted


def off_answers(gateway: str, api_key: str) -> list[tuple[str, str]]:
    """(version, text) of the opted-out tenant's greedy answers to OFF_REQUESTS."""
    answers = []
    with Client(gateway, api_key) as client:
        for request in OFF_REQUESTS:
            messages = list(
                client.generate(
                    messages=[ChatMessage(role="user", content=request)],
                    sampling=SamplingParams(max_tokens=32),
                )
            )
            answers.append((messages[0].model_version, "".join(m.text for m in messages)))
    return answers


def one_run(gguf: Path, flip: float, rate: float, timeout_s: float, tenants: bool) -> None:
    """`reflow up` and its thumbs-only users until every cohort's promotion or `timeout_s`."""
    behaviour = Behaviour(True, TEMPERATURE, flip)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        env = {**os.environ, "REFLOW_DATA_DIR": str(data), **LOOP}
        cohorts, off_key = [], ""
        if tenants:
            store = open_db(f"sqlite:///{data / 'reflow.db'}")
            migrate(store)
            for tenant, taste in (("lists", Numbered()), ("prose", Prose())):
                info, key = create_tenant(store, tenant, trains=TRAINS_OWN)
                users = Users(key, taste, behaviour, rate=rate)
                cohorts.append(Cohort(tenant, taste, users, own_promotion(Scope(tenant, info.id))))
            off_key = create_tenant(store, "off", trains=TRAINS_NOTHING)[1]
            store.dispose()
        else:
            cohorts.append(
                Cohort("", Numbered(), Users(API_KEY, Numbered(), behaviour, rate=rate), shared_promotion)
            )
        with open(data / "up.log", "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "reflow", "up", "--model", str(gguf), "--workers", "1", "--port", "0",
                 "--http-port", "0"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            endpoints = data / "endpoints.json"
            while not endpoints.is_file():
                if process.poll() is not None:
                    raise SystemExit((data / "up.log").read_text())
                time.sleep(1)
            gateway = json.loads(endpoints.read_text())["gateway"]
            off_seen = [off_answers(gateway, off_key)] if off_key else []
            for cohort in cohorts:
                cohort.users.start(gateway)
            registry = Registry(f"sqlite:///{data / 'mlflow.db'}", (data / "mlartifacts").as_uri())
            name = name_of(gguf)
            started = time.monotonic()
            promoted: dict[str, VersionRef] = {}
            while (
                time.monotonic() - started < timeout_s
                and process.poll() is None
                and len(promoted) < len(cohorts)
            ):
                time.sleep(60 if off_key else 10)
                for cohort in cohorts:
                    if cohort.tenant not in promoted and (ref := cohort.promoted(registry, name)) is not None:
                        promoted[cohort.tenant] = ref
                if off_key:
                    off_seen.append(off_answers(gateway, off_key))
            for cohort in cohorts:
                cohort.users.stop()
            for cohort in cohorts:
                report(data, registry, name, cohort, promoted.get(cohort.tenant), flip)
            if off_key:
                same = all(seen == off_seen[0] for seen in off_seen)
                versions = sorted({v for seen in off_seen for v, _ in seen})
                print(f"\nopted-out tenant: {len(off_seen)} checks of {len(OFF_REQUESTS)} greedy requests, "
                      f"served v{', v'.join(versions)}, the same tokens every time: "
                      f"{'yes' if same else 'NO'}")  # fmt: skip
        finally:
            for cohort in cohorts:
                cohort.users.stop()
            process.terminate()
            process.wait(timeout=120)


def report(
    data: Path, registry: Registry, name: str, cohort: Cohort, promoted: VersionRef | None, flip: float
) -> None:
    store = open_db(f"sqlite:///{data / 'reflow.db'}")
    whose = cohort.tenant or "default"
    with Session(store) as session:
        first = session.scalar(
            select(FeedbackItem.stored_at)
            .where(FeedbackItem.tenant == whose)
            .order_by(FeedbackItem.id)
            .limit(1)
        )
        runs = session.scalars(select(FinetuneRun).order_by(FinetuneRun.id)).all()
        promoted_at = session.scalar(
            select(Experiment.ended_at).where(
                Experiment.tenant == cohort.tenant, Experiment.status == "promoted"
            )
        )
        served = session.execute(
            select(Inference.created_at, Inference.total_ms).where(Inference.tenant == whose)
        ).all()
    store.dispose()
    users = cohort.users
    print(f"\n{whose} ({type(cohort.taste).__name__} users), {flip:.0%} of ratings flipped: "
          f"{users.report.rated} ratings sent")  # fmt: skip
    for run in runs:
        if run.tenant != cohort.tenant:
            continue
        if run.finished_at is None:
            print(f"  run {run.id}: still running at the end, on {run.samples} items")
            continue
        took = (aware(run.finished_at) - aware(run.started_at)).total_seconds()
        since = (aware(run.finished_at) - aware(first)).total_seconds() if first else 0.0
        trained = (run.metrics or {}).get("train_seconds") or 0.0
        print(f"  run {run.id}: {run.status} after {took:.0f}s (training {trained:.0f}s; {since:.0f}s from "
              f"the first rating), {run.samples} items: {run.message}")  # fmt: skip
    spans = [(aware(r.started_at), aware(r.finished_at)) for r in runs if r.finished_at]
    beside = [ms for at, ms in served if any(a <= aware(at) <= b for a, b in spans)]
    alone = [ms for at, ms in served if not any(a <= aware(at) <= b for a, b in spans)]
    for what, times in (("while no run trained", alone), ("while a run trained beside them", beside)):
        if times:
            print(f"  served {what}: {len(times)} completions, total ms p50 {percentile(times, 0.5):.0f}, "
                  f"p95 {percentile(times, 0.95):.0f}")  # fmt: skip
    for version, (liked, asked) in sorted(users.report.by_version.items()):
        print(f"  users saw v{version}: {liked}/{asked} liked ({liked / asked:.1%})")
    if promoted is None:
        print("  no promotion")
        return
    since = (aware(promoted_at) - aware(first)).total_seconds() if first and promoted_at else 0.0
    print(f"  promoted v{promoted.version} {since:.0f}s after the first rating")
    base, cache = registry.resolve(name, version="1"), data / "cache"
    before = liked_offline(registry, base, cache, cohort.taste)
    after = liked_offline(registry, promoted, cache, cohort.taste)
    print(
        f"  liked offline (96 requests, T={TEMPERATURE}): v1 {before:.1%} -> v{promoted.version} {after:.1%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flips", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--rate", type=float, default=1.5, help="requests a second")
    parser.add_argument("--timeout", type=float, default=2700.0, help="seconds a run may take to promote")
    parser.add_argument("--tenants", action="store_true", help="two tenants of opposite taste, one opted out")
    args = parser.parse_args()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = next((line.split(":")[-1].strip() for line in cpuinfo.splitlines() if "model name" in line), "?")
    amx = "yes" if "amx_tile" in cpuinfo else "no"
    per = " per tenant" if args.tenants else ""
    print(f"SmolLM2-135M-Instruct, torch {torch.__version__}, {os.cpu_count()} CPUs: {cpu}, AMX {amx}; "
          f"users at {args.rate}/s{per}, T={TEMPERATURE}, thumbs only")  # fmt: skip
    for flip in args.flips:
        one_run(smollm2_gguf(), flip, args.rate, args.timeout, args.tenants)


if __name__ == "__main__":
    main()
