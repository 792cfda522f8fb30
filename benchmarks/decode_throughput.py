"""Single-stream decode throughput: the engine in-process beside the same requests end to end.

    .venv/bin/python benchmarks/decode_throughput.py [--preset arith-small] [--requests 20] [--runs 3]

Registers a randomly initialised model of the preset in a temporary MLflow store (throughput
does not depend on the weights; sampling at temperature 1 with `<eos>` banned by max_tokens
keeps every request the same length), then measures, side by side in one run:
  * engine: tokens/s of sequential requests on an in-process Engine;
  * end to end: tokens/s, time to first token and inter-token latency seen by one gRPC client
    of a gateway process in front of a worker process (what `reflow up` runs).
Medians over --runs; the ratio says what the gRPC hops cost.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from feedback.registry import Registry
from feedback.store import migrate, open_engine
from gateway.tenants import create_tenant
from reflow.client import Client
from reflow.settings import Settings
from reflow.supervisor import Supervisor, wait_serving
from reflow.v1 import inference_pb2
from workers.engine import Engine
from workers.loading import load_directory, resolve_device
from workers.model import ModelConfig, Transformer, init_weights
from workers.sampling import SamplingParams
from workers.sequence import GenerationParams
from workers.tokenizer import ByteTokenizer

PROMPTS = [f"{a}+{b}=" for a, b in ((47, 38), (3, 5), (99, 99), (12, 40), (7, 81))]


def register_random_model(settings: Settings, preset: str) -> None:
    model = Transformer(ModelConfig.from_name(preset))
    init_weights(model, 0)
    directory = settings.data_dir / "random-model"
    model.save(directory)
    ByteTokenizer().save(directory)
    registry = Registry(settings.resolved_tracking_uri, settings.resolved_artifact_root)
    registry.register(settings.model_name, directory, params={"preset": preset}, metrics={}, alias="champion")


async def engine_rate(directory: Path, n: int, max_tokens: int) -> float:
    engine = Engine()
    engine.add(load_directory(directory, "arith", "1", resolve_device("cpu")))
    tokens, started = 0, time.perf_counter()
    for i in range(n):
        params = GenerationParams(max_tokens, SamplingParams(temperature=1.0, seed=i + 1))
        async for delta in engine.generate("arith", "1", ByteTokenizer().encode(PROMPTS[i % 5]), params):
            tokens += len(delta.token_ids)
    engine.close()
    return tokens / (time.perf_counter() - started)


def end_to_end(address: str, api_key: str, n: int, max_tokens: int) -> tuple[float, float, float]:
    """tokens/s, median time to first token (ms), median inter-token latency (ms)."""
    tokens, ttfts, gaps = 0, [], []
    started = time.perf_counter()
    with Client(address, api_key) as client:
        for i in range(n):
            sampling = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i + 1)
            sent = last = time.perf_counter()
            for j, message in enumerate(client.generate(PROMPTS[i % 5], sampling=sampling)):
                now = time.perf_counter()
                (ttfts if j == 0 else gaps).append((now - (sent if j == 0 else last)) * 1000)
                last = now
                if message.finish_reason:
                    tokens += message.usage.completion_tokens
    return tokens / (time.perf_counter() - started), statistics.median(ttfts), statistics.median(gaps)


def main() -> None:
    import torch  # imported through workers/ first, which sets OMP_WAIT_POLICY

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="arith-small")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), device="cpu", gateway_port=0)
        register_random_model(settings, args.preset)
        engine = open_engine(settings.resolved_database_url)
        migrate(engine)
        _, api_key = create_tenant(engine, "bench", requests_per_minute=0)
        supervisor = Supervisor(settings)
        env = {"REFLOW_DATA_DIR": tmp, "REFLOW_DEVICE": "cpu"}
        try:
            worker = supervisor.wait_ready(supervisor.spawn("worker", ["worker"], env))["address"]
            gateway_child = supervisor.spawn(
                "gateway", ["gateway", "--port", "0"], {**env, "REFLOW_WORKERS": worker}
            )
            gateway = supervisor.wait_ready(gateway_child)["address"]
            wait_serving(gateway)
            end_to_end(gateway, api_key, 3, args.max_tokens)  # warm up both processes
            engine_runs, e2e_runs = [], []
            for _ in range(args.runs):  # alternate, so drift hits both alike
                engine_runs.append(
                    asyncio.run(engine_rate(Path(tmp) / "random-model", args.requests, args.max_tokens))
                )
                e2e_runs.append(end_to_end(gateway, api_key, args.requests, args.max_tokens))
        finally:
            supervisor.stop()
    engine_tps = statistics.median(engine_runs)
    e2e_tps = statistics.median(r[0] for r in e2e_runs)
    print(f"preset {args.preset}, {args.requests} sequential requests x {args.max_tokens} tokens, "
          f"median of {args.runs} runs, torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"engine, in-process          {engine_tps:8.0f} tokens/s")
    print(f"end to end, one gRPC client {e2e_tps:8.0f} tokens/s   "
          f"TTFT p50 {statistics.median(r[1] for r in e2e_runs):.2f} ms   "
          f"inter-token p50 {statistics.median(r[2] for r in e2e_runs):.2f} ms")  # fmt: skip
    print(f"end to end / engine         {e2e_tps / engine_tps:8.2f}")


if __name__ == "__main__":
    main()
