"""The learning loop on thumbs alone, as a deployment without an answer key runs it, on
SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/thumbs_loop.py [--flips 0.1 0] [--rate 1.5] [--timeout 2700]

For each share of flipped ratings, in a fresh data directory: `reflow up --model GGUF --workers 1`
(no --demo, no REFLOW_TASK: the job sees ratings and nothing else), and simulated users of the
`numbered` task (feedback/tasks/numbered.py) sending chat requests at temperature 0.9, `--rate` a
second, who like an answer laid out as a numbered list and say so only by thumbs, that share of
them the wrong way round. Prints, per run: the seconds from the first rating to the first
registered challenger and to its promotion; what the users saw, the share of answers they liked
from the champion and from the challenger while both served; the share of the base and the
promoted version's answers to 96 fresh requests, sampled offline at the same temperature and seed,
they would like; each fine-tune run's time and verdict; the latency of the completions served while
a run trained beside them and while none did (training and serving share the 2 cores: the job
waits passively, docs/benchmarks.md); and the CPU.
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
from pathlib import Path

import torch
from hot_swap import percentile  # this script's directory is on sys.path
from sqlalchemy import select
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from feedback.tasks.numbered import Numbered
from feedback.tasks.simulate import Behaviour
from reflow.cli.models import name_of
from reflow.registry import CHAMPION, SOURCE_TAG, Registry
from reflow.store.database import open_engine
from reflow.store.tables import FeedbackItem, FinetuneRun, Inference, aware
from tests.support.smollm2 import smollm2_gguf
from tests.support.users import Users
from workers.models.greedy import completions
from workers.models.loader import load_checkpoint
from workers.models.prompts import user_turn

API_KEY = "rf_bench_thumbs_0123456789"
TEMPERATURE = 0.9
LOOP = {  # the demo's schedule (docs/experiments.md), with no task and no simulated users of its own
    "REFLOW_FINETUNE_INTERVAL_S": "30", "REFLOW_FINETUNE_MIN_SAMPLES": "300", "REFLOW_AB_TRAFFIC": "0.5",
    "REFLOW_AB_EVALUATE_S": "10", "REFLOW_ISOLATION": "none", "REFLOW_API_KEY": API_KEY,
}  # fmt: skip


def liked_offline(directory: Path, n: int = 96) -> float:
    """The share of a version's sampled answers to `n` fresh requests the users would like."""
    model, tokenizer = load_checkpoint(directory)
    task = Numbered()
    prompts = task.traffic_prompts(n, random.Random(99))
    answers = completions(
        model, tokenizer, [user_turn(p) for p in prompts], temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(9), batch_size=32,
    )  # fmt: skip
    return sum(task.is_correct(p, a) for p, (_, a) in zip(prompts, answers, strict=True)) / n


def one_run(gguf: Path, flip: float, rate: float, timeout_s: float) -> None:
    """`reflow up` and its thumbs-only users until a promotion or `timeout_s`."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        env = {**os.environ, "REFLOW_DATA_DIR": str(data), **LOOP}
        with open(data / "up.log", "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "reflow", "up", "--model", str(gguf), "--workers", "1", "--port", "0",
                 "--http-port", "0"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        users = Users(API_KEY, Numbered(), Behaviour(True, TEMPERATURE, flip), rate=rate)
        try:
            endpoints = data / "endpoints.json"
            while not endpoints.is_file():
                if process.poll() is not None:
                    raise SystemExit((data / "up.log").read_text())
                time.sleep(1)
            users.start(json.loads(endpoints.read_text())["gateway"])
            registry = Registry(f"sqlite:///{data / 'mlflow.db'}", (data / "mlartifacts").as_uri())
            started = time.monotonic()
            promoted = None
            while time.monotonic() - started < timeout_s and process.poll() is None and promoted is None:
                time.sleep(10)
                champion = registry.resolve(name_of(gguf), alias=CHAMPION)
                promoted = champion if registry.tags(champion).get(SOURCE_TAG) == "merge" else None
            users.stop()
            report(data, registry, name_of(gguf), promoted, users, flip)
        finally:
            users.stop()
            process.terminate()
            process.wait(timeout=120)


def report(data: Path, registry: Registry, name: str, promoted: object, users: Users, flip: float) -> None:
    store = open_engine(f"sqlite:///{data / 'reflow.db'}")
    with Session(store) as session:
        first = session.scalar(select(FeedbackItem.stored_at).order_by(FeedbackItem.id).limit(1))
        runs = session.scalars(select(FinetuneRun).order_by(FinetuneRun.id)).all()
        served = session.execute(select(Inference.created_at, Inference.total_ms)).all()
    store.dispose()
    print(f"\n{flip:.0%} of ratings flipped: {users.report.rated} ratings sent")
    for run in runs:
        if run.finished_at is None:
            print(f"  run {run.id}: still running at the end, on {run.samples} items")
            continue
        took = (aware(run.finished_at) - aware(run.started_at)).total_seconds() if run.finished_at else 0.0
        since = (aware(run.finished_at) - aware(first)).total_seconds() if run.finished_at and first else 0.0
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
    version = promoted.version  # type: ignore[attr-defined]
    merged = registry.client.get_model_version(name, version)
    at = merged.creation_timestamp / 1000
    since = at - aware(first).timestamp() if first else 0.0
    adapter = merged.tags["reflow.merged_from"]
    print(f"  promoted v{version} (merged from v{adapter}) {since:.0f}s after the first rating")
    base = registry.download(registry.resolve(name, version="1"), data / "cache")
    after = registry.download(registry.resolve(name, version=version), data / "cache")
    print(f"  liked offline (96 requests, T={TEMPERATURE}): v1 {liked_offline(base):.1%} -> "
          f"v{version} {liked_offline(after):.1%}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flips", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--rate", type=float, default=1.5, help="requests a second")
    parser.add_argument("--timeout", type=float, default=2700.0, help="seconds a run may take to promote")
    args = parser.parse_args()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = next((line.split(":")[-1].strip() for line in cpuinfo.splitlines() if "model name" in line), "?")
    amx = "yes" if "amx_tile" in cpuinfo else "no"
    print(f"SmolLM2-135M-Instruct, torch {torch.__version__}, {os.cpu_count()} CPUs: {cpu}, AMX {amx}; "
          f"users at {args.rate}/s, T={TEMPERATURE}, thumbs only")  # fmt: skip
    for flip in args.flips:
        one_run(smollm2_gguf(), flip, args.rate, args.timeout)


if __name__ == "__main__":
    main()
