"""What one fine-tune run buys: champion vs challenger accuracy in range and over the wide range.

    .venv/bin/python benchmarks/finetune_gain.py [--items 400] [--runs 3]

Trains the demo base model with the default recipe (about a minute), then per run (seeds 0..runs-1)
in a fresh store and MLflow registry: --items wide-range (0-99) prompts answered greedily by the
champion and rated by oracle users (+1, or -1 with the right answer as correction), one fine-tune
job with the default settings, and greedy accuracy of champion and candidate on 500 in-range
(0-49) and 500 wide-range (0-99) problems. Prints each run and the medians, with the job's wall
time (training alone, and the whole job: training, gate, MLflow).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from feedback.intake.consumer import store_events
from feedback.job_scheduler import finetune_job_of
from feedback.tasks import get_task
from feedback.tasks.simulate import rated_offline
from feedback.training.evaluation import base_model_metrics
from feedback.training.job import run_finetune
from feedback.training.pretrain import PretrainConfig, train_base_model
from reflow.registry import CHALLENGER, Registry
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from workers.models.loader import load_checkpoint, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    started = time.perf_counter()
    task = get_task("arith")
    base, tokenizer = train_base_model(PretrainConfig(), task)
    print(f"base model trained in {time.perf_counter() - started:.0f}s", flush=True)
    before = base_model_metrics(base, tokenizer, task)
    rows = []
    for seed in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            directory = Path(tmp)
            registry = Registry(f"sqlite:///{directory / 'mlflow.db'}", (directory / "mlartifacts").as_uri())
            checkpoint = save_checkpoint(base, tokenizer, directory / "base")
            registry.register("arith", checkpoint, params={}, metrics={}, alias="champion")
            settings = Settings(data_dir=directory, mlflow_tracking_uri=registry.tracking_uri,
                                mlflow_artifact_root=registry.artifact_root or "", device="cpu")  # fmt: skip
            db = open_db(settings.resolved_database_url)
            migrate(db)
            prompts = task.traffic_prompts(args.items, random.Random(100 + seed))
            with db.begin() as connection:
                store_events(connection, rated_offline(base, tokenizer, task, prompts, tenant="bench"))
            job_started = time.perf_counter()
            outcome = run_finetune(finetune_job_of(settings), db, registry, min_samples=1)
            job_s = time.perf_counter() - job_started
            if outcome.status != "registered":
                print(f"run {seed + 1}: {outcome.status}: {outcome.message}")
                continue
            candidate, _ = load_checkpoint(
                registry.download(registry.resolve("arith", alias=CHALLENGER), settings.model_cache_dir)
            )
            after = base_model_metrics(candidate, tokenizer, task)
            db.dispose()
        train_s = (outcome.metrics or {})["train_seconds"]
        rows.append((after["accuracy_in_range"], after["accuracy_wide_range"], train_s, job_s))
        print(
            f"run {seed + 1}: in range {before['accuracy_in_range']:.1%} -> "
            f"{after['accuracy_in_range']:.1%}, "
            f"wide {before['accuracy_wide_range']:.1%} -> {after['accuracy_wide_range']:.1%}; "
            f"training {train_s:.0f}s, whole job {job_s:.0f}s",
            flush=True,
        )
    if not rows:
        return
    narrow, wide, train, job = (statistics.median(column) for column in zip(*rows, strict=True))
    print(f"\nmedians of {len(rows)} registered runs, {args.items} rated items each:")
    print(f"  in range (0-49):  champion {before['accuracy_in_range']:.1%}  challenger {narrow:.1%}  "
          f"({100 * (narrow - before['accuracy_in_range']):+.1f} points)")  # fmt: skip
    print(f"  wide (0-99):      champion {before['accuracy_wide_range']:.1%}  challenger {wide:.1%}  "
          f"({100 * (wide - before['accuracy_wide_range']):+.1f} points)")  # fmt: skip
    print(f"  fine-tune wall time: training {train:.0f}s, whole job {job:.0f}s")


if __name__ == "__main__":
    main()
