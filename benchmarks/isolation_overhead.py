"""What worker isolation costs: requests/s and latency of gateway -> worker streams with the eBPF
programs attached and without, measured alternately in one run.

    sudo .venv/bin/python benchmarks/isolation_overhead.py [--preset arith-small] [--rounds 12]
        [--seconds 8] [--concurrency 8] [--connections-per-request]

Starts two worker processes serving the same random `preset` model: one with REFLOW_ISOLATION=ebpf,
one with none. This process joins the gateway's cgroup, as the gateway does, and streams
completions (16 tokens) straight to the workers' Generate, --concurrency at a time, for --seconds,
alternating isolated / not isolated for --rounds rounds each. Streams share one HTTP/2 connection,
as the gateway's do; --connections-per-request opens a new connection per request instead, the
worst case for the ingress program (every request is a new connection). Prints each round, the
medians, and the ratio (target: isolated at most 3% slower).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from decode_throughput import register_random_model  # this script's directory is on sys.path
from hot_swap import percentile

from reflow.cgroups import IsolationUnavailable, current_group, join, join_gateway_group, remove_instance
from reflow.cli.supervisor import Supervisor
from reflow.settings import Settings
from reflow.v1 import inference_pb2, worker_pb2, worker_pb2_grpc
from workers.isolation.host import DEFAULT_OBJECT, check_host

LOCAL_POOL = ("grpc.use_local_subchannel_pool", 1)


async def round_of(
    address: str, seconds: float, concurrency: int, per_request: bool
) -> tuple[float, list[float]]:
    """(requests/s, latencies in s) of `seconds` of streams to one worker."""
    latencies: list[float] = []
    shared = grpc.aio.insecure_channel(address)
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        while time.perf_counter() < deadline:
            request = worker_pb2.WorkerGenerateRequest(
                request_id=f"bench-{i}", model="arith", version="1", prompt=f"{i % 90}+{(i * 7) % 90}=",
                sampling=inference_pb2.SamplingParams(max_tokens=16),
            )  # fmt: skip
            started = time.perf_counter()
            # a local subchannel pool: a channel of its own is a TCP connection of its own
            channel = grpc.aio.insecure_channel(address, options=[LOCAL_POOL]) if per_request else shared
            async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(request, timeout=60):
                pass
            if per_request:
                await channel.close()
            latencies.append(time.perf_counter() - started)
            i += concurrency

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    await shared.close()
    return len(latencies) / elapsed, latencies


def admitted_connections(metrics_url: str) -> float:
    """New connections the isolated worker's ingress program admitted, from its metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(
        r'reflow_worker_isolation_connections_total\{direction="inbound",verdict="admitted"\} (\S+)', text
    )
    return float(found.group(1)) if found else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="arith-small")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--connections-per-request", action="store_true")
    args = parser.parse_args()
    try:
        check_host(DEFAULT_OBJECT)
    except IsolationUnavailable as error:
        sys.exit(f"cannot measure isolation here: {error}")
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), device="cpu", isolation="ebpf")
        register_random_model(settings, args.preset)
        supervisor = Supervisor(settings)
        env = {"REFLOW_DATA_DIR": tmp, "REFLOW_DEVICE": "cpu", "REFLOW_REGISTRY_POLL_S": "0"}
        results: dict[str, list[tuple[float, float, float]]] = {"ebpf": [], "none": []}
        requests = {"ebpf": 0, "none": 0}
        origin = current_group()
        try:
            ready = {
                mode: supervisor.wait_ready(supervisor.spawn(f"worker-{mode}", ["worker"],
                                                             {**env, "REFLOW_ISOLATION": mode}))
                for mode in ("ebpf", "none")
            }  # fmt: skip
            workers = {mode: r["address"] for mode, r in ready.items()}
            assert join_gateway_group(settings.data_dir, create=False), "the gateway's cgroup is missing"
            asyncio.run(round_of(workers["none"], 2.0, args.concurrency, False))  # warm-up, both
            asyncio.run(round_of(workers["ebpf"], 2.0, args.concurrency, False))
            for round_number in range(args.rounds):
                order = ("ebpf", "none") if round_number % 2 == 0 else ("none", "ebpf")
                for mode in order:
                    rate, latencies = asyncio.run(
                        round_of(workers[mode], args.seconds, args.concurrency, args.connections_per_request)
                    )
                    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
                    results[mode].append((rate, p50, p99))
                    requests[mode] += len(latencies)
                    print(f"round {round_number + 1} isolation={mode}: {rate:.1f} requests/s, "
                          f"p50 {1000 * p50:.1f} ms, p99 {1000 * p99:.1f} ms", flush=True)  # fmt: skip
            admitted = admitted_connections(ready["ebpf"]["metrics"])
        finally:
            supervisor.stop()
            join(origin)  # out of the gateway's group, so it can be removed
            remove_instance(settings.data_dir)
    on, off = (
        [statistics.median(column) for column in zip(*results[m], strict=True)] for m in ("ebpf", "none")
    )
    kind = "a new connection per request" if args.connections_per_request else "one shared connection"
    print(f"\nmedians of {args.rounds} rounds, {args.concurrency} concurrent streams, {kind}, {args.preset}:")
    print(f"  requests/s  isolated {on[0]:.1f}  not {off[0]:.1f}  ratio {on[0] / off[0]:.3f}")
    print(f"  p50 ms      isolated {1000 * on[1]:.1f}  not {1000 * off[1]:.1f}  ratio {on[1] / off[1]:.3f}")
    print(f"  p99 ms      isolated {1000 * on[2]:.1f}  not {1000 * off[2]:.1f}  ratio {on[2] / off[2]:.3f}")
    print(f"  new connections the isolated worker checked and admitted: {admitted:.0f} "
          f"(for {requests['ebpf']} requests)")  # fmt: skip


if __name__ == "__main__":
    main()
