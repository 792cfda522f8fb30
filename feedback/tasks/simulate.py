"""`reflow simulate`: a population of users sending a task's prompts through the gateway and rating
each answer with the task's oracle: +1 when right, -1 when wrong, and, unless they only click
thumbs, the right answer as `correction` (where the task has one).

It is the demo's traffic and the learning loop's test: users judge by an oracle the model does not
know (a right answer, or a taste), and their ratings are all the loop learns from. `Behaviour`
makes them more like people: sampled answers (a temperature), thumbs only, and a share of
ratings given the wrong way round.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeVar

import grpc
import torch

from feedback.events import ChatMessage, FeedbackEvent, InferenceEvent, Latency, TokenUsage
from feedback.tasks.task import Task, as_prompt
from reflow.errors import RETRY_PUSHBACK_KEY
from reflow.gateway_tls import client_credentials
from reflow.mtls import open_channel
from reflow.store.tables import DEFAULT_MAX_STREAMS
from reflow.v1 import inference_pb2, inference_pb2_grpc
from workers.models.greedy import completions
from workers.models.interface import CausalLM, Tokenizer
from workers.models.prompts import prompt_ids

# Requests a simulation keeps open at once, beyond which it falls behind its rate: within a new
# tenant's stream quota, so that its users, like a client that bounds its concurrency, are not
# refused when answers slow down (a fine-tune training on the same cores); half of it, since a
# stream its client has seen end still counts at the gateway until the gateway's handler returns
MAX_IN_FLIGHT = DEFAULT_MAX_STREAMS // 2
RETRIES = 20  # times a user comes back after RESOURCE_EXHAUSTED before giving up
T = TypeVar("T")


@dataclass(frozen=True)
class Behaviour:
    """How the simulated users ask and rate."""

    thumbs_only: bool = False  # True: ratings alone, never a correction
    temperature: float = 0.0  # of their requests; 0 = greedy
    flip: float = 0.0  # share of ratings sent the wrong way round (noise)
    max_tokens: int = 48


@dataclass
class SimulationReport:
    """What the simulated users saw, and how much of it they rated."""

    requests: int = 0  # sent
    finished: int = 0  # answered or failed
    right: int = 0  # answers the oracle accepts (whatever the rating sent said)
    errors: dict[str, int] = field(default_factory=dict)  # Generate: gRPC status name -> count
    feedback_errors: dict[str, int] = field(default_factory=dict)  # SubmitFeedback failures
    rated: int = 0  # feedback items the gateway accepted
    by_version: dict[str, list[int]] = field(default_factory=dict)  # version -> [right, answered]

    @property
    def accuracy(self) -> float:
        answered = self.requests - sum(self.errors.values())
        return self.right / answered if answered else 0.0


async def simulate(
    target: str,
    api_key: str,
    *,
    task: Task,
    rate: float,
    duration_s: float,
    users: int = 50,
    seed: int = 0,
    model: str = "",
    on_request: Callable[[SimulationReport], None] | None = None,
    ca_file: str | None = None,
    behaviour: Behaviour = Behaviour(),
) -> SimulationReport:
    """Sends `rate` of `task`'s live-traffic prompts a second for `duration_s` seconds (at most
    `rate * duration_s`; 0 = until cancelled), each from one of `users` users, and rates every
    answer as `behaviour` says; returns once all are answered and rated. With `ca_file`, over TLS
    trusting that CA."""
    rng = random.Random(seed)
    flips = random.Random(seed + 1)  # apart, so noise does not change which prompts are asked
    report = SimulationReport()
    metadata = (("authorization", f"Bearer {api_key}"),)
    ratings: asyncio.Queue[inference_pb2.Feedback | None] = asyncio.Queue()
    async with open_channel(target, client_credentials(ca_file), grpc.aio) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        rater = asyncio.create_task(_rate(stub, metadata, ratings, report))
        in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        asked: set[asyncio.Task[None]] = set()  # requests in flight
        started = time.monotonic()
        for i in range(int(rate * duration_s)) if duration_s else itertools.count():
            await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
            [prompt] = task.traffic_prompts(1, rng)
            user = f"sim-user-{rng.randrange(users)}"
            await in_flight.acquire()
            flipped = flips.random() < behaviour.flip
            asking = asyncio.create_task(
                _ask(
                    stub,
                    metadata,
                    model,
                    task,
                    prompt,
                    user=user,
                    report=report,
                    ratings=ratings,
                    behaviour=behaviour,
                    flipped=flipped,
                )
            )
            asking.add_done_callback(lambda _t: in_flight.release())
            if on_request is not None:
                asking.add_done_callback(lambda _t: on_request(report))
            asked.add(asking)
            asking.add_done_callback(asked.discard)
        await asyncio.gather(*asked)
        await ratings.put(None)
        await rater
    return report


async def _ask(
    stub: inference_pb2_grpc.InferenceStub,
    metadata: tuple[tuple[str, str], ...],
    model: str,
    task: Task,
    prompt: str,
    *,
    user: str,
    report: SimulationReport,
    ratings: asyncio.Queue[inference_pb2.Feedback | None],
    behaviour: Behaviour,
    flipped: bool,
) -> None:
    """One user's request, and its rating queued (the wrong way round when `flipped`)."""
    sampling = inference_pb2.SamplingParams(
        max_tokens=behaviour.max_tokens, temperature=behaviour.temperature
    )
    request = inference_pb2.GenerateRequest(model=model, user_id=user, sampling=sampling)
    if task.chat:  # the worker renders it with the model's chat template
        request.messages.append(inference_pb2.ChatMessage(role="user", content=prompt))
    else:
        request.prompt = prompt
    report.requests += 1
    answer = ""
    request_id = version = ""

    async def generate() -> None:
        nonlocal answer, request_id, version
        text: list[str] = []
        async for message in stub.Generate(request, metadata=metadata, timeout=60):
            request_id = request_id or message.request_id
            version = version or message.model_version
            text.append(message.text)
        answer = "".join(text)

    try:
        await _admitted(generate)
    except grpc.aio.AioRpcError as error:
        report.errors[error.code().name] = report.errors.get(error.code().name, 0) + 1
        return
    finally:
        report.finished += 1
    right = task.is_correct(prompt, answer)
    report.right += right
    tally = report.by_version.setdefault(version, [0, 0])
    tally[0] += right
    tally[1] += 1
    correction = "" if right or behaviour.thumbs_only else task.answer(prompt) or ""
    await ratings.put(
        inference_pb2.Feedback(
            request_id=request_id, rating=1 if right != flipped else -1, correction=correction, user_id=user
        )
    )


async def _admitted(call: Callable[[], Awaitable[T]]) -> T:
    """What `call` returns, calling it again while the gateway refuses it RESOURCE_EXHAUSTED (a
    full quota or queue, which says when to come back), at most RETRIES times; its last error."""
    for _ in range(RETRIES):
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await asyncio.sleep(_pushback_s(error))
    return await call()


def _pushback_s(error: grpc.aio.AioRpcError) -> float:
    """The server's `grpc-retry-pushback-ms` trailer in seconds, else a quarter of a second."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_PUSHBACK_KEY:
            return int(value) / 1000
    return 0.25


async def _rate(
    stub: inference_pb2_grpc.InferenceStub,
    metadata: tuple[tuple[str, str], ...],
    ratings: asyncio.Queue[inference_pb2.Feedback | None],
    report: SimulationReport,
) -> None:
    """Sends queued ratings in one SubmitFeedback stream per second (or per 500 items)."""
    done = False
    while not done:
        batch: list[inference_pb2.Feedback] = []
        deadline = time.monotonic() + 1.0
        while len(batch) < 500:
            try:
                item = await asyncio.wait_for(ratings.get(), timeout=max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                break
            if item is None:
                done = True
                break
            batch.append(item)
        if batch:
            try:
                report.rated += await _submit(stub, metadata, batch)
            except grpc.aio.AioRpcError as error:
                key = f"SubmitFeedback {error.code().name}"
                report.feedback_errors[key] = report.feedback_errors.get(key, 0) + 1


async def _submit(
    stub: inference_pb2_grpc.InferenceStub,
    metadata: tuple[tuple[str, str], ...],
    batch: list[inference_pb2.Feedback],
) -> int:
    """How many of `batch` the gateway accepted, sent again while it refuses the stream
    RESOURCE_EXHAUSTED (a refused stream takes none of them): users of two gateways share their
    tenant's stream quota, and a rating is what the loop learns from."""
    ack = await _admitted(lambda: stub.SubmitFeedback(iter(batch), metadata=metadata, timeout=60))
    return ack.accepted


def rated_offline(
    model: CausalLM,
    tokenizer: Tokenizer,
    task: Task,
    prompts: list[str],
    *,
    tenant: str,
    model_name: str = "arith",
    version: str = "1",
    answer_key: Callable[[str], str | None] | None = None,
    behaviour: Behaviour = Behaviour(),
    users: int = 0,
    seed: int = 0,
) -> list[InferenceEvent | FeedbackEvent]:
    """What simulated users would send for `prompts`, without a gateway: the events of `model`'s
    completions (greedy, or sampled at `behaviour.temperature`) and ratings against `answer_key` (+1,
    or -1 with its answer as correction unless they rate thumbs only), the task's oracle by
    default; prompt i is asked by user `sim-user-{i % users}` (none when `users` is 0).

    For measuring and testing the fine-tune job alone; a wrong `answer_key` makes harmful feedback.
    """
    generated = completions(
        model, tokenizer, [as_prompt(task, p) for p in prompts], temperature=behaviour.temperature,
        generator=torch.Generator().manual_seed(seed), max_new_tokens=behaviour.max_tokens,
    )  # fmt: skip
    flips = random.Random(seed + 1)
    now = datetime.now(UTC)
    events: list[InferenceEvent | FeedbackEvent] = []
    for i, (prompt, (thought, answer)) in enumerate(zip(prompts, generated, strict=True)):
        request_id, wanted = f"offline-{i}", (answer_key or task.answer)(prompt) or ""
        right = task.is_correct(prompt, answer) if answer_key is None else answer.strip() == wanted
        flipped = flips.random() < behaviour.flip
        events.append(InferenceEvent(
            request_id=request_id, tenant=tenant, model=model_name, version=version,
            prompt="" if task.chat else prompt,
            messages=[ChatMessage(role="user", content=prompt)] if task.chat else None,
            reasoning=thought or "", completion=answer, finish_reason="STOP",
            usage=TokenUsage(
                prompt_tokens=len(prompt_ids(tokenizer, as_prompt(task, prompt))), completion_tokens=0,
                reasoning_tokens=0,
            ),
            latency=Latency(first_token_ms=0.0, total_ms=0.0), time=now,
        ))  # fmt: skip
        events.append(FeedbackEvent(
            feedback_id=f"offline-{i}", request_id=request_id, tenant=tenant,
            rating=1 if right != flipped else -1,
            correction="" if right or behaviour.thumbs_only else wanted,
            user_id=f"sim-user-{i % users}" if users else "", time=now,
        ))  # fmt: skip
    return events
