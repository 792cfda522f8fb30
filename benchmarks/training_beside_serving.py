"""Training beside serving: how torch's threads wait decides a fine-tune step's time, and the
latency of what a worker serves meanwhile, when both share the cores (as in `reflow up`).

    .venv/bin/python benchmarks/training_beside_serving.py [--steps 16] [--rate 8] [--runs 1]

Starts a worker and a gateway (as `reflow up` does) on a randomly initialised arith-small model, and
a client sending --rate requests a second (arith prompts, 48 tokens each, the most `reflow
simulate` asks for; open loop). Then, for each way a training process's threads may wait, runs
--steps steps of the demo's fine-tune (the default recipe over 300 rated arith items, on a random
arith-small model) in a process of its own, first alone and then beside the served traffic:
  * default: OpenMP's default, threads spin 300,000 iterations before they sleep;
  * spin 10000: GOMP_SPINCOUNT=10000, what a worker uses (workers.threads.spin_briefly);
  * passive: OMP_WAIT_POLICY=PASSIVE, what `reflow scheduler` and `reflow finetune run` use
    (workers.threads.wait_passively);
  * 1 thread: OMP_NUM_THREADS=1.
Prints, per policy, the median step time (the first 3 steps left out) alone and beside serving,
and the served requests' latency p50 and p99 while it trained. Policies alternate across --runs,
medians over runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from decode_throughput import served  # this script's directory is on sys.path
from hot_swap import percentile

from reflow.v1 import inference_pb2, inference_pb2_grpc

POLICIES = {
    "default": {},
    "spin 10000": {"GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
WAITING = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")
TOKENS = 48  # what `reflow simulate` asks for
SKIPPED_STEPS = 3  # the first steps warm the allocator and the autograd graph

TRAINER = """
import json, random, sys, time
from feedback.tasks import get_task
from feedback.training.dataset import RatedCompletion, build_dataset
from feedback.training.job import replay_source
from feedback.training.trainer import FinetuneConfig, train_candidate
from workers.models.builtin import new_model
task, rng = get_task("arith"), random.Random(0)
model, tokenizer = new_model("arith-small", 0)
items = [RatedCompletion(id=i, feedback_id=str(i), prompt=p, reasoning="", completion="0", rating=-1,
                         correction=task.answer(p))
         for i, p in enumerate(task.traffic_prompts(300, rng), 1)]
dataset = build_dataset(items, 0.1, task.thought)
times = [time.perf_counter()]
train_candidate(model, tokenizer, dataset, replay_source(task, model, tokenizer, ()),
                FinetuneConfig(steps=int(sys.argv[1])), lambda *_: times.append(time.perf_counter()))
print(json.dumps([b - a for a, b in zip(times, times[1:])]))
"""


def step_seconds(policy: dict[str, str], steps: int) -> float:
    """The median step time of a demo fine-tune process with `policy`'s environment."""
    env = {k: v for k, v in os.environ.items() if k not in WAITING} | policy
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, str(steps)], env=env, check=True, capture_output=True, text=True
    )
    return statistics.median(json.loads(done.stdout.splitlines()[-1])[SKIPPED_STEPS:])


class Traffic:
    """An open-loop client on its own thread: `rate` requests a second, each latency kept with the
    time it was sent."""

    def __init__(self, address: str, api_key: str, rate: float) -> None:
        self.address, self.api_key, self.rate = address, api_key, rate
        self.latencies: list[tuple[float, float]] = []  # (sent, seconds)
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def between(self, start: float, end: float) -> list[float]:
        return [seconds for sent, seconds in self.latencies if start <= sent < end]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    async def _run(self) -> None:
        metadata = (("authorization", f"Bearer {self.api_key}"),)
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)

            async def one(i: int) -> None:
                sampling = inference_pb2.SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=i + 1)
                request = inference_pb2.GenerateRequest(
                    prompt=f"{i * 37 % 100}+{i * 91 % 100}=", sampling=sampling
                )
                sent = time.perf_counter()
                try:
                    async for _ in stub.Generate(request, metadata=metadata):
                        pass
                except grpc.aio.AioRpcError:
                    self.failed += 1
                    return
                self.latencies.append((sent, time.perf_counter() - sent))

            tasks, i, started = set(), 0, time.perf_counter()
            while not self._stop.is_set():
                task = asyncio.create_task(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(max(0.0, started + i / self.rate - time.perf_counter()))
            await asyncio.gather(*tasks)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    alone: dict[str, list[float]] = {name: [] for name in POLICIES}
    beside: dict[str, list[float]] = {name: [] for name in POLICIES}
    p50: dict[str, list[float]] = {name: [] for name in POLICIES}
    p99: dict[str, list[float]] = {name: [] for name in POLICIES}
    for _ in range(args.runs):
        for name, policy in POLICIES.items():
            alone[name].append(step_seconds(policy, args.steps))
    with served("arith-small") as (_, gateway, api_key):
        traffic = Traffic(gateway, api_key, args.rate)
        time.sleep(3.0)  # the worker's first batches: compiled kernels, allocator
        baseline_start = time.perf_counter()
        time.sleep(10.0)
        serving_alone = traffic.between(baseline_start, time.perf_counter())
        for _ in range(args.runs):
            for name, policy in POLICIES.items():
                start = time.perf_counter()
                beside[name].append(step_seconds(policy, args.steps))
                answered = traffic.between(start, time.perf_counter())
                p50[name].append(percentile(answered, 0.5) * 1000)
                p99[name].append(percentile(answered, 0.99) * 1000)
        traffic.stop()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")  # fmt: skip
    print(f"{cpu}, {len(os.sched_getaffinity(0))} cores; demo fine-tune, {args.steps} steps per run "
          f"(first {SKIPPED_STEPS} left out), {args.rate:g} requests/s of {TOKENS} tokens, "
          f"median of {args.runs} run(s); {traffic.failed} failed requests")  # fmt: skip
    print(f"serving alone: latency p50 {percentile(serving_alone, 0.5) * 1000:.0f} ms, "
          f"p99 {percentile(serving_alone, 0.99) * 1000:.0f} ms")  # fmt: skip
    header = f"{'policy':>12} {'step alone s':>13} {'beside s':>9} {'x alone':>8}"
    print(f"{header} {'served p50 ms':>14} {'p99 ms':>7}")
    for name in POLICIES:
        a, b = statistics.median(alone[name]), statistics.median(beside[name])
        print(f"{name:>12} {a:>13.3f} {b:>9.3f} {b / a:>8.1f} "
              f"{statistics.median(p50[name]):>14.0f} {statistics.median(p99[name]):>7.0f}")  # fmt: skip
    passive = statistics.median(beside["passive"])
    for name in POLICIES:
        print(f"{name} / passive beside serving: {statistics.median(beside[name]) / passive:.2f}")


if __name__ == "__main__":
    main()
