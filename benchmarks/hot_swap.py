"""Hot-swap under load: from an alias change to every worker serving the new version, and latency
during the swap beside steady state, with the count of failed requests (it must be 0).

    .venv/bin/python benchmarks/hot_swap.py [--preset arith-small] [--workers 2] [--clients 8] [--runs 6]

Registers two randomly initialised models of the preset (versions 1 and 2), starts worker processes
that follow `champion` every second (REFLOW_REGISTRY_POLL_S=1) and a gateway in front of them, and
keeps --clients concurrent clients streaming completions. Each run measures steady state for 8 s,
then moves `champion` to the other version (1 -> 2, 2 -> 1, ...) and measures until every worker
reports the new version under the alias, and until the old one is unloaded; "during the swap" is
from the alias change to that unload. Runs alternate between leaving the workers to their poll and
pushing the change to them (the SyncAliases RPC, as `reflow models promote` and the evaluate job
do). Latency is per request, from the client's side. Prints each run and the medians per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from decode_throughput import register_random_model  # this script's directory is on sys.path

from feedback.experiments.promotion import push_to_workers
from gateway.tenants import UNLIMITED, create_tenant
from reflow.cli.supervisor import Supervisor, wait_serving
from reflow.registry import Registry
from reflow.settings import Settings
from reflow.store.database import migrate, open_db
from reflow.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from reflow.worker_calls import WorkerTargets

STEADY_S = 8.0


def register_versions(settings: Settings, preset: str) -> Registry:
    """arith v1 (@champion) and v2, random weights of `preset` with seeds 0 and 1."""
    register_random_model(settings, preset, seed=0, alias="champion")
    register_random_model(settings, preset, seed=1, alias="staged")
    registry = Registry.from_settings(settings)
    registry.delete_alias("arith", "staged")
    return registry


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def serving(workers: list[str], version: str, *, alone: bool) -> bool:
    """True when every worker holds `champion` on `version` (and, if `alone`, nothing else)."""
    for address in workers:
        async with grpc.aio.insecure_channel(address) as channel:
            status = await worker_pb2_grpc.WorkerStub(channel).Status(worker_pb2.WorkerStatusRequest())
        held = {v.version: set(v.aliases) for v in status.loaded}
        if "champion" not in held.get(version, set()) or (alone and len(held) > 1):
            return False
    return True


async def run_once(
    gateway: str, api_key: str, workers: list[str], registry: Registry, target: str, clients: int, push: bool
):
    """One swap to `target` under load: (seconds to the alias moving on every worker, seconds to the
    old version unloaded everywhere, steady latencies, latencies during the swap, failures)."""
    samples: list[tuple[float, float]] = []  # (start, latency) of successful requests
    failures = 0
    stop = asyncio.Event()
    metadata = (("authorization", f"Bearer {api_key}"),)

    async def client(i: int) -> None:
        nonlocal failures
        async with grpc.aio.insecure_channel(gateway) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            while not stop.is_set():
                request = inference_pb2.GenerateRequest(
                    prompt=f"{(i * 37) % 100}+{(i * 11) % 100}=",
                    sampling=inference_pb2.SamplingParams(max_tokens=16),
                )
                started = time.perf_counter()
                try:
                    async for _ in stub.Generate(request, metadata=metadata, timeout=60):
                        pass
                    samples.append((started, time.perf_counter() - started))
                except grpc.aio.AioRpcError as error:
                    failures += 1
                    if failures <= 3:
                        print(f"  failed: {error.code().name}: {error.details()}", flush=True)
                i += clients

    tasks = [asyncio.create_task(client(i)) for i in range(clients)]
    await asyncio.sleep(STEADY_S)
    swap_at = time.perf_counter()
    await asyncio.to_thread(registry.set_alias, "arith", "champion", target)
    if push:
        await asyncio.to_thread(push_to_workers, WorkerTargets(configured=tuple(workers)))
    while not await serving(workers, target, alone=False):  # noqa: ASYNC110 (polling other processes)
        await asyncio.sleep(0.05)
    moved_at = time.perf_counter()
    while not await serving(workers, target, alone=True):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    done_at = time.perf_counter()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*tasks)
    steady = [latency for start, latency in samples if swap_at - STEADY_S + 2 <= start < swap_at]
    during = [latency for start, latency in samples if swap_at <= start < done_at]
    return moved_at - swap_at, done_at - swap_at, steady, during, failures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="arith-small")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), device="cpu", gateway_port=0, http_port=0)
        registry = register_versions(settings, args.preset)
        store = open_db(settings.resolved_database_url)
        migrate(store)
        _, api_key = create_tenant(store, "bench", limits=UNLIMITED)
        supervisor = Supervisor(settings)
        bootstrap = supervisor.spawn_broker()  # the gateway's event sink
        # isolation off: this process asks the workers for their status itself (isolated workers
        # admit only the gateway's cgroup); benchmarks/isolation_overhead.py measures isolation
        env = {"REFLOW_DATA_DIR": tmp, "REFLOW_DEVICE": "cpu", "REFLOW_REGISTRY_POLL_S": "1",
               "REFLOW_KAFKA_BOOTSTRAP": bootstrap, "REFLOW_ISOLATION": "none"}  # fmt: skip
        try:
            workers = [
                supervisor.wait_ready(supervisor.spawn(f"worker-{i}", ["worker"], env))["address"]
                for i in range(args.workers)
            ]
            gateway = supervisor.wait_ready(
                supervisor.spawn(
                    "gateway", ["gateway", "--port", "0"], {**env, "REFLOW_WORKERS": ",".join(workers)}
                )
            )["address"]
            wait_serving(gateway)
            for run in range(args.runs):
                target, push = ("2" if run % 2 == 0 else "1"), run % 4 in (1, 2)  # poll, push, push, poll
                swap_s, unload_s, steady, during, failures = asyncio.run(
                    run_once(gateway, api_key, workers, registry, target, args.clients, push)
                )
                rows.append((swap_s, unload_s, percentile(steady, 0.5), percentile(steady, 0.99),
                             percentile(during, 0.5), percentile(during, 0.99), failures, push))  # fmt: skip
                print(
                    f"run {run + 1} ({'push' if push else 'poll'}): champion -> v{target} on every worker "
                    f"in {swap_s:.2f}s, old version "
                    f"unloaded after {unload_s:.1f}s; latency p50/p99 "
                    f"steady {1000 * rows[-1][2]:.0f}/{1000 * rows[-1][3]:.0f} ms, during the swap "
                    f"{1000 * rows[-1][4]:.0f}/{1000 * rows[-1][5]:.0f} ms ({len(during)} requests); "
                    f"failed requests {failures}",
                    flush=True,
                )
        finally:
            supervisor.stop()
    print(f"\nmedians, {args.workers} workers, {args.clients} clients, {args.preset}:")
    for push in (False, True):
        mode = [row for row in rows if row[7] == push]
        if not mode:
            continue
        swap, unload, s50, s99, d50, d99 = (statistics.median(c) for c in list(zip(*mode, strict=True))[:6])
        print(f" {'pushed to the workers' if push else 'registry poll every 1 s'} ({len(mode)} swaps):")
        print(f"  alias change -> every worker serving the new version: {swap:.2f} s")
        print(f"  alias change -> the old version unloaded everywhere: {unload:.1f} s (after 10 s idle)")
        print(f"  latency p50 steady {1000 * s50:.0f} ms, during swap {1000 * d50:.0f} ms ({d50 / s50:.2f}x)")
        print(f"  latency p99 steady {1000 * s99:.0f} ms, during swap {1000 * d99:.0f} ms ({d99 / s99:.2f}x)")
    print(f"  failed requests: {sum(row[6] for row in rows)} in all runs")


if __name__ == "__main__":
    main()
