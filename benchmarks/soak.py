"""A soak run: mixed traffic for a long time against `reflow up` with two gateways sharing a Redis,
through a worker crash and a Redis restart, watching every process's memory and, at the end,
that nothing acknowledged was lost or stored twice.

    .venv/bin/python benchmarks/soak.py [--minutes 20] [--clients 12]

Starts a redis-server of its own and `reflow up --workers 2 --gateways 2` on the built-in demo model
(its tiny preset, so the two CPU cores here spend their time on traffic) in a temp dir. --clients
concurrent clients then send, to either gateway and either face, a mix of:
  * completions read to their end (gRPC streams, HTTP streamed and whole completions);
  * streams cancelled after their first tokens, and requests whose latency budget runs out;
  * ratings of finished completions in batches of up to 50, each batch sent twice (a client's
    retry: the second must store nothing new);
and, on the way, a worker is killed (`reflow up` starts it again) at a third of the run and Redis is
restarted at two thirds. Each minute (from half a minute in) the pipeline also gets what it must
keep out of the store without holding anything else up:
  * a record Kafka refuses for good (2 MB, over the producer's limit), put at the head of the
    gateways' outbox as a long completion once was: it must become a dead letter, and the ratings
    queued behind it must still arrive;
  * a forged rating and a forged inference event (a request id never served to the tenant),
    written straight to the topics: the consumer must send them to the DLQ, not store them.
Every 10 s the RSS of each of up's children (with its own children) is sampled. At the end, once
the consumer has stored what Kafka holds, the store is read:
  * lost: finished completions without an inference row, acknowledged ratings without a row;
  * duplicated: rows stored more than once (request ids and feedback ids are unique keys, so
    this counts ids stored under a second row id, which would be a bug in the keys);
  * RSS growth per process from the end of warm-up (a fifth of the run) to the end; a restarted
    worker from its own warm-up;
  * the oversized records among the dead letters (`reflow feedback dead-letters`), the forged
    events in the DLQ and none of them stored.
Targets (issue 16): RSS growth ≤ 5% per process after warm-up; 0 lost, 0 duplicated; every
oversized record a dead letter, every forged event in the DLQ, none stored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.support, run from anywhere

from feedback.bus.kafka import new_producer
from feedback.bus.outbox import Outbox
from feedback.events import FeedbackEvent, InferenceEvent, Latency, TokenUsage
from feedback.intake.stats import kafka_stats
from reflow.endpoints import read_endpoints
from reflow.kafka_settings import PLAINTEXT
from reflow.store.tables import utcnow
from reflow.v1 import inference_pb2, inference_pb2_grpc
from tests.support.cli import reflow
from tests.support.redis import RedisServer, SharedRedis
from tests.support.up import descendants

KEY = "rf_soak_key_0123456789"
TENANT = "default"  # the tenant `reflow up` makes for KEY
SAMPLE_EVERY_S = 10.0
INJECT_EVERY_S = 60.0
OVERSIZED_BYTES = 2_000_000  # over REFLOW_MAX_EVENT_BYTES, so over the gateways' producer limit


@dataclass
class Tally:
    """What the clients saw: finished completions, acknowledged ratings, and every outcome."""

    finished: set[str] = field(default_factory=set)  # request ids that ended with a finish reason
    acknowledged: set[str] = field(default_factory=set)  # feedback ids a gateway accepted
    outcomes: Counter[str] = field(default_factory=Counter)
    unrated: list[str] = field(default_factory=list)  # finished, not yet rated


class Clients:
    """One gRPC channel and one HTTP client per gateway replica."""

    def __init__(self, replicas: list[dict[str, str]]):
        self.channels = [grpc.aio.insecure_channel(r["address"]) for r in replicas]
        self.stubs = [inference_pb2_grpc.InferenceStub(c) for c in self.channels]
        self.http = [
            httpx.AsyncClient(base_url=r["http"], headers={"authorization": f"Bearer {KEY}"}, timeout=60)
            for r in replicas
        ]
        self.metadata = (("authorization", f"Bearer {KEY}"),)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        for http in self.http:
            await http.aclose()


def prompt(rng: random.Random) -> str:
    return f"{rng.randrange(100)}+{rng.randrange(100)}="


async def grpc_stream(clients: Clients, rng: random.Random, tally: Tally, cancel_after: int = 0) -> None:
    """A gRPC stream read to its end, or cancelled after `cancel_after` messages."""
    stub = rng.choice(clients.stubs)
    request = inference_pb2.GenerateRequest(
        prompt=prompt(rng), sampling=inference_pb2.SamplingParams(max_tokens=rng.randrange(4, 24))
    )
    call = stub.Generate(request, metadata=clients.metadata, timeout=60)
    request_id, read = "", 0
    try:
        async for message in call:
            request_id = request_id or message.request_id
            read += 1
            if cancel_after and read >= cancel_after:
                call.cancel()
                tally.outcomes["grpc cancelled"] += 1
                return
            if message.finish_reason:
                tally.finished.add(request_id)
                tally.unrated.append(request_id)
        tally.outcomes["grpc finished"] += 1
    except grpc.aio.AioRpcError as error:
        tally.outcomes[f"grpc {refusal(error)}"] += 1


def refusal(error: grpc.aio.AioRpcError) -> str:
    """A failed call's status, and for RESOURCE_EXHAUSTED which limit said no."""
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:  # never expected: say what was wrong
        return f"INVALID_ARGUMENT ({(error.details() or '')[:80]})"
    if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return error.code().name
    return f"RESOURCE_EXHAUSTED ({limit_of(error.details() or '')})"


def limit_of(message: str) -> str:
    """Which limit a 429 / RESOURCE_EXHAUSTED message names."""
    return next((q for q in ("concurrent streams", "per minute", "full queue") if q in message), "?")


async def grpc_deadline(clients: Clients, rng: random.Random, tally: Tally) -> None:
    """A request whose latency budget (or the client's deadline) is too short for it."""
    request = inference_pb2.GenerateRequest(
        prompt=prompt(rng),
        sampling=inference_pb2.SamplingParams(max_tokens=32),
        latency_budget_ms=rng.choice([5, 50]),
    )
    try:
        async for message in rng.choice(clients.stubs).Generate(
            request, metadata=clients.metadata, timeout=2
        ):
            if message.finish_reason:
                tally.finished.add(message.request_id)
        tally.outcomes["budget finished anyway"] += 1
    except grpc.aio.AioRpcError as error:
        tally.outcomes[f"budget {refusal(error)}"] += 1


async def http_completion(clients: Clients, rng: random.Random, tally: Tally) -> None:
    """An OpenAI completion, streamed or whole."""
    http = rng.choice(clients.http)
    body = {"model": "arith", "prompt": prompt(rng), "max_tokens": rng.randrange(4, 24), "temperature": 0}
    try:
        if rng.random() < 0.5:
            response = await http.post("/v1/completions", json=body)
            if response.status_code == 200:
                tally.finished.add(response.json()["id"])
                tally.unrated.append(response.json()["id"])
            limit = (
                f" ({limit_of(response.json()['error']['message'])})" if response.status_code == 429 else ""
            )
            tally.outcomes[f"http {response.status_code}{limit}"] += 1
            return
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            request_id, outcome = (
                response.headers.get("x-request-id", ""),
                f"http stream {response.status_code}",
            )
            async for line in response.aiter_lines():
                event = json.loads(line.removeprefix("data: ")) if line.startswith("data: {") else {}
                if "error" in event:  # a stream that failed after its first token says so, then [DONE]
                    outcome = f"http stream error {event['error']['code']}"
                elif event and event["choices"] and event["choices"][0]["finish_reason"]:
                    tally.finished.add(request_id)
                    tally.unrated.append(request_id)
            tally.outcomes[outcome] += 1
    except httpx.HTTPError as error:
        tally.outcomes[f"http {type(error).__name__}"] += 1


async def rate(clients: Clients, rng: random.Random, tally: Tally) -> None:
    """Ratings of finished completions, sent twice (gRPC or HTTP NDJSON); acknowledged ids noted."""
    batch, tally.unrated[:] = tally.unrated[:50], tally.unrated[50:]
    if not batch:
        return
    items = [(f"soak-{uuid.uuid4().hex}", request_id, rng.choice([-1, 1])) for request_id in batch]
    for attempt in range(2):  # the second is a retry that must store nothing new
        if rng.random() < 0.5:
            feedback = [inference_pb2.Feedback(feedback_id=f, request_id=r, rating=v) for f, r, v in items]
            try:
                ack = await rng.choice(clients.stubs).SubmitFeedback(
                    iter(feedback), metadata=clients.metadata, timeout=30
                )
            except grpc.aio.AioRpcError as error:
                tally.outcomes[f"feedback grpc {refusal(error)}"] += 1
                continue
            rejected = {e.index for e in ack.errors}
        else:
            lines = "\n".join(
                f'{{"feedback_id": "{f}", "request_id": "{r}", "rating": {v}}}' for f, r, v in items
            )
            response = await rng.choice(clients.http).post(
                "/v1/feedback", content=lines, headers={"content-type": "application/x-ndjson"}
            )
            if response.status_code != 200:
                tally.outcomes[f"feedback http {response.status_code}"] += 1
                continue
            rejected = {e["index"] for e in response.json().get("errors", [])}
        tally.outcomes[f"feedback sent {'twice' if attempt else 'once'}"] += 1
        tally.acknowledged.update(f for i, (f, _, _) in enumerate(items) if i not in rejected)


async def client(clients: Clients, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        kind = rng.random()
        if kind < 0.40:
            await grpc_stream(clients, rng, tally)
        elif kind < 0.55:
            await grpc_stream(clients, rng, tally, cancel_after=2)
        elif kind < 0.65:
            await grpc_deadline(clients, rng, tally)
        elif kind < 0.92:
            await http_completion(clients, rng, tally)
        else:
            await rate(clients, rng, tally)


@dataclass
class Injected:
    """What the soak slipped into the pipeline: records Kafka refuses for good, and forged events."""

    oversized: int = 0
    forged_ratings: set[str] = field(default_factory=set)  # feedback ids
    forged_requests: set[str] = field(default_factory=set)  # request ids of forged inference events


def inference_event(request_id: str, completion: str) -> InferenceEvent:
    """An inference event of `TENANT`'s, as a gateway would publish it."""
    return InferenceEvent(
        request_id=request_id, tenant=TENANT, model="arith", version="1", prompt="1+1=",
        completion=completion, finish_reason="LENGTH", time=utcnow(),
        usage=TokenUsage(prompt_tokens=4, completion_tokens=len(completion), reasoning_tokens=0),
        latency=Latency(first_token_ms=1.0, total_ms=2.0),
    )  # fmt: skip


def inject_once(data_dir: Path, kafka: str, injected: Injected) -> None:
    """An oversized record at the head of the gateways' outbox (the one the gateways of `reflow
    up` share), and a forged rating and inference event straight onto the topics."""
    n = injected.oversized
    oversized = inference_event(f"soak-oversized-{n}", "9" * OVERSIZED_BYTES).to_record()
    outbox = Outbox(data_dir / "outbox.db")
    outbox.append([oversized])
    outbox.close()
    injected.oversized += 1
    forged_request = secrets.token_hex(24)  # the shape of a request id, signed by nobody
    forged = [
        FeedbackEvent(
            feedback_id=f"forged-{n}", request_id=forged_request, tenant=TENANT, rating=1, time=utcnow()
        ).to_record(),
        inference_event(forged_request, "2").to_record(),
    ]
    producer = new_producer(kafka, security=PLAINTEXT)  # the embedded broker's
    for record in forged:
        producer.send(record.topic, key=record.key, value=record.value)
    producer.flush()
    producer.close()
    injected.forged_ratings.add(f"forged-{n}")
    injected.forged_requests.add(forged_request)


async def inject(data_dir: Path, kafka: str, until: float, injected: Injected) -> None:
    """`inject_once` each INJECT_EVERY_S, the first half of it into the run."""
    await asyncio.sleep(INJECT_EVERY_S / 2)
    while time.monotonic() < until:
        await asyncio.to_thread(inject_once, data_dir, kafka, injected)
        await asyncio.sleep(INJECT_EVERY_S)


def children_of(up_pid: int) -> dict[str, int]:
    """`reflow up`'s direct children by the name it gave them (their ready file, or their command)."""
    named = {}
    for pid in descendants(up_pid):
        with contextlib.suppress(OSError):
            if int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1]) != up_pid:
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            ready = [a for a in argv if a.endswith(b".json") and b"/run/" in a]
            name = (
                Path(ready[0].decode()).stem
                if ready
                else next(
                    (
                        n
                        for n in ("scheduler", "mlflow", "tansu", "simulate")
                        if any(n.encode() in a for a in argv)
                    ),
                    "?",
                )
            )
            named[name] = pid
    return named


def rss_mib(pid: int) -> float:
    """The resident memory of `pid` and everything below it."""
    total = 0
    for each in {pid, *descendants(pid)}:
        with contextlib.suppress(OSError):
            lines = Path(f"/proc/{each}/status").read_text().splitlines()
            status = dict(line.split(":", 1) for line in lines)
            total += int(status.get("VmRSS", "0 kB").split()[0])  # a zombie has none
    return total / 1024


async def sample_memory(up_pid: int, until: float, samples: dict[str, list[tuple[float, float]]]) -> None:
    """(seconds since start, RSS MiB) of each child every SAMPLE_EVERY_S; a restarted child's samples
    restart under the same name, marked by its new pid."""
    started = time.monotonic()
    while time.monotonic() < until:
        for name, pid in children_of(up_pid).items():
            samples.setdefault(f"{name}[{pid}]", []).append((time.monotonic() - started, rss_mib(pid)))
        await asyncio.sleep(SAMPLE_EVERY_S)


async def disturb(up_pid: int, redis_server: RedisServer, duration_s: float, log: list[str]) -> None:
    """A worker killed at a third of the run, Redis restarted at two thirds."""
    await asyncio.sleep(duration_s / 3)
    worker = children_of(up_pid)["worker-1"]
    os.kill(worker, signal.SIGKILL)
    log.append(f"{time.strftime('%H:%M:%S')} killed worker-1 (pid {worker}); reflow up starts it again")
    await asyncio.sleep(duration_s / 3)
    redis_server.stop()
    log.append(f"{time.strftime('%H:%M:%S')} stopped Redis")
    await asyncio.sleep(5)
    redis_server.start()
    log.append(f"{time.strftime('%H:%M:%S')} started Redis again")


def stored(data_dir: Path, tally: Tally, timeout_s: float = 120) -> tuple[Counter[str], Counter[str]]:
    """Request ids of the stored inferences and feedback ids of the stored ratings, with their
    counts, once the consumer has caught up (nothing new for 10 s, or everything expected seen)."""
    deadline, last, quiet_since = time.monotonic() + timeout_s, (-1, -1), time.monotonic()
    while True:
        with contextlib.closing(sqlite3.connect(data_dir / "reflow.db")) as db:
            inferences = Counter(r for (r,) in db.execute("SELECT request_id FROM inferences"))
            ratings = Counter(
                f for (f,) in db.execute("SELECT feedback_id FROM feedback WHERE feedback_id LIKE 'soak-%'")
            )
        counts = (sum(inferences.values()), sum(ratings.values()))
        if counts != last:
            last, quiet_since = counts, time.monotonic()
        complete = tally.finished <= set(inferences) and tally.acknowledged <= set(ratings)
        if complete or time.monotonic() - quiet_since > 10 or time.monotonic() > deadline:
            return inferences, ratings
        time.sleep(1)


def forged_rows(data_dir: Path, injected: Injected) -> int:
    """Rows the store holds of the forged events (the target is none)."""
    with contextlib.closing(sqlite3.connect(data_dir / "reflow.db")) as db:
        ratings = db.execute("SELECT count(*) FROM feedback WHERE feedback_id LIKE 'forged-%'").fetchone()[0]
        requests = list(injected.forged_requests)
        marks = ",".join("?" * len(requests))
        inferences = db.execute(f"SELECT count(*) FROM inferences WHERE request_id IN ({marks})", requests)
        return int(ratings) + int(inferences.fetchone()[0])


def report(samples: dict[str, list[tuple[float, float]]], duration_s: float) -> None:
    warm = duration_s / 5
    print(f"\nRSS (MiB) from the end of warm-up ({warm:.0f} s into each process's life) to the end:")
    print(f"{'process':<22} {'warm':>8} {'end':>8} {'growth':>8} {'samples':>8}")
    for name, series in sorted(samples.items()):
        start = series[0][0]
        after = [rss for at, rss in series if at >= start + warm]
        if len(after) < 3:
            print(f"{name:<22} {'(too short-lived to say)':>34}")
            continue
        first = statistics.median(after[:3])  # medians of three: a sample is one moment's noise
        last = statistics.median(after[-3:])
        print(f"{name:<22} {first:>8.1f} {last:>8.1f} {(last - first) / first:>+8.1%} {len(series):>8}")


async def soak(
    endpoints: dict[str, Any],
    up_pid: int,
    redis_server: RedisServer,
    args: argparse.Namespace,
    data_dir: Path,
    injected: Injected,
) -> Tally:
    duration_s = args.minutes * 60
    clients = Clients(endpoints["gateways"])
    tally, samples, log = Tally(), dict[str, list[tuple[float, float]]](), list[str]()
    until = time.monotonic() + duration_s
    gateways = ", ".join(r["address"] for r in endpoints["gateways"])
    print(f"soak: {args.minutes} min, {args.clients} clients, gateways {gateways}")
    await asyncio.gather(
        *(client(clients, seed, until, tally) for seed in range(args.clients)),
        sample_memory(up_pid, until, samples),
        inject(data_dir, endpoints["kafka"], until, injected),
        *([] if args.calm else [disturb(up_pid, redis_server, duration_s, log)]),
    )
    while tally.unrated:  # rate what is left, so every finished completion's rating is checked
        await rate(clients, random.Random(0), tally)
    await clients.close()
    for wait_s in (1, 16):  # every stream has ended: no slot is held, not even until its lease runs out
        await asyncio.sleep(wait_s)
        held = SharedRedis(redis_server.url, "reflow:").held_slots()  # up's gateways use the default prefix
        log.append(f"stream slots held in Redis {wait_s} s after the traffic: {held}")
    print("\n".join(log))
    print("\noutcomes:", ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    report(samples, duration_s)
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--calm", action="store_true", help="no worker crash, no Redis restart")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        redis_server = RedisServer(Path(tmp))
        redis_server.start()
        env = {
            **os.environ, "REFLOW_API_KEY": KEY, "REFLOW_MODEL_PRESET": "tiny", "REFLOW_DEVICE": "cpu",
            "REFLOW_BOOTSTRAP_STEPS": "50", "REFLOW_REDIS_URL": redis_server.url,
            "REFLOW_FINETUNE_INTERVAL_S": "86400",  # no fine-tune: the memory watched is the serving path's
        }  # fmt: skip
        with open(Path(tmp) / "up.log", "w") as log:
            up = subprocess.Popen(
                [sys.executable, "-m", "reflow", "up", "--data-dir", str(data), "--workers", "2",
                 "--gateways", "2", "--port", "0", "--http-port", "0", "--max-streams", "48"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            while (endpoints := read_endpoints(data)) is None:
                if up.poll() is not None:
                    sys.exit("reflow up did not start:\n" + (Path(tmp) / "up.log").read_text()[-3000:])
                time.sleep(0.5)
            injected = Injected()
            tally = asyncio.run(soak(endpoints, up.pid, redis_server, args, data, injected))
            inferences, ratings = stored(data, tally)
            in_dlq = kafka_stats(endpoints["kafka"], security=PLAINTEXT)["dlq_messages"]
            forged_stored = forged_rows(data, injected)
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(120)
            redis_server.stop()
        lost_inferences = tally.finished - set(inferences)
        lost_ratings = tally.acknowledged - set(ratings)
        print(
            f"\nfinished completions {len(tally.finished)}: lost {len(lost_inferences)}, "
            f"duplicated {sum(n > 1 for n in inferences.values())}"
        )
        print(f"acknowledged ratings {len(tally.acknowledged)}: lost {len(lost_ratings)}, "
              f"duplicated {sum(n > 1 for n in ratings.values())}, "
              f"stored unacknowledged {len(set(ratings) - tally.acknowledged)}")  # fmt: skip
        for what, ids in (("inference", lost_inferences), ("rating", lost_ratings)):
            for missing in sorted(ids)[:5]:
                print(f"  lost {what}: {missing}")
        shown = reflow("feedback", "dead-letters", "--json", env={"REFLOW_DATA_DIR": str(data)})
        dead = [d for d in json.loads(shown.stdout) if d["key"].startswith("soak-oversized-")]
        print(f"oversized records put in front of the outbox {injected.oversized}: dead letters {len(dead)}")
        forged = len(injected.forged_ratings) + len(injected.forged_requests)
        print(
            f"forged events {forged} (ratings, inference events): stored {forged_stored}, in the DLQ {in_dlq}"
        )


if __name__ == "__main__":
    main()
