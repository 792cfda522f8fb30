"""Decode throughput and latency at 1, 8, 32 and 64 concurrent streams: engine vs end to end.

    .venv/bin/python benchmarks/decode_throughput.py [--preset arith-small] [--requests 64] [--runs 3]

Registers a randomly initialised model of the preset in a temporary MLflow store (throughput
does not depend on the weights), then measures, side by side in one run, the same requests
(mixed prompt lengths, max_tokens 16-64, seeded sampling so lengths repeat):
  * engine: an in-process Engine with at most C streams in flight; C=1 is the requests run
    one after another;
  * end to end: C concurrent gRPC clients of a gateway process in front of a worker process
    (what `reflow up` runs), all on this machine's cores.
For each, aggregate tokens/s, time to first token, and inter-token latency per request as
(total - TTFT) / (tokens - 1) (p50, p99 across requests, from the client's side). Medians
over --runs, levels alternating so drift hits all alike.
"""

from __future__ import annotations

from workers.threads import spin_briefly

spin_briefly()  # the engine runs in this process as in a worker's: before torch loads

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gateway.tenants import UNLIMITED, create_tenant
from reflow.cli.supervisor import Supervisor, wait_serving
from reflow.registry import Registry
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from reflow.v1 import inference_pb2, inference_pb2_grpc
from workers.engine import Engine
from workers.loading import load_directory
from workers.models.builtin import TOKENIZER, new_model
from workers.models.loader import resolve_device, save_checkpoint
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams

LEVELS = (1, 8, 32, 64)


def workload(n: int) -> list[tuple[str, int, int]]:
    """(prompt, max_tokens, seed) for n requests: short arith prompts and longer texts."""
    requests = []
    for i in range(n):
        prompt = f"{(i * 37) % 100}+{(i * 91) % 100}=" if i % 3 else f"question {i}: " + "x" * (i % 40)
        requests.append((prompt, 16 + (i * 13) % 49, i + 1))
    return requests


@dataclass
class Run:
    """Tokens and per-request latencies of one measurement."""

    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def record(self, sent: float, first: float, done: float, tokens: int) -> None:
        """One finished request: sent, first token and last token times, tokens generated."""
        self.tokens += tokens
        self.ttft.append(first - sent)
        if tokens > 1:
            self.itl.append((done - first) / (tokens - 1))


async def bounded(concurrency: int, jobs: list) -> None:
    semaphore = asyncio.Semaphore(concurrency)

    async def run(job) -> None:
        async with semaphore:
            await job()

    await asyncio.gather(*(run(j) for j in jobs))


async def engine_run(engine: Engine, requests: list[tuple[str, int, int]], concurrency: int) -> Run:
    run, tokenizer = Run(), TOKENIZER

    async def one(prompt: str, max_tokens: int, seed: int) -> None:
        params = GenerationParams(max_tokens, SamplingParams(temperature=1.0, seed=seed))
        sent, first, tokens = time.perf_counter(), 0.0, 0
        async for delta in engine.generate("arith", "1", tokenizer.encode(prompt), params):
            first = first or time.perf_counter()
            tokens += len(delta.token_ids)
        run.record(sent, first, time.perf_counter(), tokens)

    started = time.perf_counter()
    await bounded(concurrency, [lambda r=r: one(*r) for r in requests])
    run.seconds = time.perf_counter() - started
    return run


async def grpc_run(address: str, api_key: str, requests: list[tuple[str, int, int]], concurrency: int) -> Run:
    run = Run()
    metadata = (("authorization", f"Bearer {api_key}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(prompt: str, max_tokens: int, seed: int) -> None:
            sampling = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)
            request = inference_pb2.GenerateRequest(prompt=prompt, sampling=sampling)
            sent, first, tokens = time.perf_counter(), 0.0, 0
            async for message in stub.Generate(request, metadata=metadata):
                first = first or time.perf_counter()
                tokens = message.usage.completion_tokens or tokens
            run.record(sent, first, time.perf_counter(), tokens)

        started = time.perf_counter()
        await bounded(concurrency, [lambda r=r: one(*r) for r in requests])
        run.seconds = time.perf_counter() - started
    return run


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000


def summarize(runs: list[Run]) -> tuple[float, float, float, float, float]:
    """Median over runs of tokens/s, TTFT p50/p99 and inter-token p50/p99 (ms)."""
    med = statistics.median
    return (
        med(r.rate for r in runs),
        med(pct(r.ttft, 0.5) for r in runs), med(pct(r.ttft, 0.99) for r in runs),
        med(pct(r.itl, 0.5) for r in runs), med(pct(r.itl, 0.99) for r in runs),
    )  # fmt: skip


def register_random_model(settings: Settings, preset: str, seed: int = 0, alias: str = "champion") -> Path:
    """Registers a randomly initialised `preset` model (throughput does not depend on the weights).
    It is made on a thread that then ends, so that this process keeps no OpenMP team besides its
    engine's: a second one throttles both (workers/engine.py)."""
    with ThreadPoolExecutor(1) as pool:
        model, tokenizer = pool.submit(new_model, preset, seed).result()
    directory = save_checkpoint(model, tokenizer, settings.data_dir / f"random-model-{seed}")
    registry = Registry.from_settings(settings)
    registry.register(settings.model_name, directory, params={"preset": preset}, metrics={}, alias=alias)
    return directory


@contextlib.contextmanager
def served(preset: str) -> Iterator[tuple[Path, str, str]]:
    """A worker and a gateway process (what `reflow up` runs) serving a random `preset` model as
    arith v1 @champion in a temp data dir: (the model's directory, the gateway's address, an API
    key without limits); stopped on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), device="cpu", gateway_port=0, http_port=0)
        directory = register_random_model(settings, preset)
        store = open_db(settings.resolved_database_url)
        migrate(store)
        _, api_key = create_tenant(store, "bench", limits=UNLIMITED)
        supervisor = Supervisor(settings)
        env = {"REFLOW_DATA_DIR": tmp, "REFLOW_DEVICE": "cpu"}
        try:
            env["REFLOW_KAFKA_BOOTSTRAP"] = supervisor.spawn_broker()  # where the gateway sends events
            worker = supervisor.wait_ready(supervisor.spawn("worker", ["worker"], env))["address"]
            gateway_child = supervisor.spawn(
                "gateway", ["gateway", "--port", "0"], {**env, "REFLOW_WORKERS": worker}
            )
            gateway = supervisor.wait_ready(gateway_child)["address"]
            wait_serving(gateway)
            yield directory, gateway, api_key
        finally:
            supervisor.stop()


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="arith-small")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    requests = workload(args.requests)
    engine_runs: dict[int, list[Run]] = {c: [] for c in LEVELS}
    e2e_runs: dict[int, list[Run]] = {c: [] for c in LEVELS}
    with served(args.preset) as (directory, gateway, api_key):

        async def measure() -> None:
            engine = Engine()  # the version built on its thread, as a worker builds it
            engine.add(engine.run(lambda: load_directory(directory, "arith", "1", resolve_device("cpu"))))
            await engine_run(engine, requests[:8], 8)  # warm up both paths
            await grpc_run(gateway, api_key, requests[:8], 8)
            for _ in range(args.runs):
                for c in LEVELS:
                    engine_runs[c].append(await engine_run(engine, requests, c))
                    e2e_runs[c].append(await grpc_run(gateway, api_key, requests, c))
            engine.close()

        asyncio.run(measure())
    print(f"preset {args.preset}: {args.requests} requests, prompts 5-53 tokens, max_tokens 16-64, "
          f"median of {args.runs} runs, torch threads {torch.get_num_threads()}")  # fmt: skip
    header = (
        f"{'':>14} {'C':>3} {'tokens/s':>9} {'x C=1':>6} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}"
    )
    print(header + "   (ms)")
    base: dict[str, tuple[float, ...]] = {}
    for name, runs in (("engine", engine_runs), ("end to end", e2e_runs)):
        for c in LEVELS:
            rate, t50, t99, i50, i99 = summarize(runs[c])
            first = base.setdefault(name, (rate, i50))
            latencies = f"{t50:>9.2f} {t99:>7.2f} {i50:>8.2f} {i99:>7.2f}"
            print(f"{name:>14} {c:>3} {rate:>9.0f} {rate / first[0]:>6.2f} {latencies}")
    for c in LEVELS:
        ratio = summarize(e2e_runs[c])[0] / summarize(engine_runs[c])[0]
        print(f"end to end / engine at C={c}: {ratio:.2f}")
    for name, runs in (("engine", engine_runs), ("end to end", e2e_runs)):
        print(f"{name}: ITL p50 at C=32 / C=1: {summarize(runs[32])[3] / summarize(runs[1])[3]:.2f}")


if __name__ == "__main__":
    main()
