"""Several choices of one completion request (OpenAI's `n`, and `best_of` on text completions): a
generation per choice, each with a request id of its own, so feedback can rate the choice a user
kept, `preferred_over` the others: a preference pair of one prompt, which the loop trains on.

- All choices are in the arm of the first, so the same version answers them and a preference
  compares samples of one model.
- The first starts alone. The others start once its first message came, when its prompt's full
  KV blocks are in its worker's prefix cache, and are placed beside it (the same worker and copy,
  while it serves them), so each prefills only the prompt's last partial block.
- Choice i samples with the request's seed plus i (a seed of 0 stays a fresh one for each), so
  seeded choices differ from each other and come again the same.
- The usage counts the prompt once, as the tenant's token quota does (gateway/service.py).
- `best_of` generates that many and keeps the n with the highest mean log probability per token
  (OpenAI's "best"), ranked by it; the rest were generated and logged but are never shown.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Awaitable, Iterable
from typing import TypeVar

from gateway.http.translation import Messages
from gateway.service import InferenceService
from gateway.tenants import TenantInfo
from reflow.errors import InvalidArgument
from reflow.v1 import inference_pb2

SEEDS = 2**64 - 1  # the nonzero seeds: 0 asks for a fresh one
T = TypeVar("T")
Item = tuple[int, inference_pb2.GenerateResponse] | BaseException | None


class Choices:
    """The generations of `count` choices of `request`: started with `begin`, then their messages
    by choice. Close it to stop every one at its worker's next step."""

    def __init__(
        self,
        service: InferenceService,
        tenant: TenantInfo,
        request: inference_pb2.GenerateRequest,
        count: int,
        received: float,
        param: str = "n",
    ):
        if 0 < tenant.max_concurrent_streams < count:
            raise InvalidArgument(
                f"{param}={count} generates {count} choices at once, and tenant {tenant.name!r} may hold "
                f"{tenant.max_concurrent_streams} concurrent streams; ask for fewer",
                param=param,
            )
        self.service = service
        self.tenant = tenant
        self.request = request
        self.count = count
        self.first = service.start(tenant, request, received=received)
        self.streams = [service.stream(self.first)]
        self._pumps: list[asyncio.Task[None]] = []

    @property
    def request_id(self) -> str:
        """The first choice's request id: the completion's `id`."""
        return self.first.request_id

    async def begin(self) -> Messages:
        """Every choice's first message, the first choice's before the others start; the first
        error of any, every choice stopped."""
        try:
            firsts = [await anext(self.streams[0])]
            for index in range(1, self.count):
                generation = self.service.start(
                    self.tenant, seeded(self.request, index), received=self.first.received, beside=self.first
                )  # fmt: skip
                self.streams.append(self.service.stream(generation))
            return firsts + await _all(anext(stream) for stream in self.streams[1:])
        except BaseException:
            await self.aclose()
            raise

    async def rest(self) -> AsyncGenerator[tuple[int, inference_pb2.GenerateResponse]]:
        """Each choice's messages after its first, with its index, as they come; the first error
        of any. A reader that falls behind holds the choices back, so each relay coalesces its
        worker's deltas as it does for one slow stream."""
        if len(self.streams) == 1:
            async for message in self.streams[0]:
                yield 0, message
            return
        queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=len(self.streams))

        async def pump(index: int, stream: AsyncGenerator[inference_pb2.GenerateResponse]) -> None:
            try:
                async for message in stream:
                    await queue.put((index, message))
            except Exception as error:
                await queue.put(error)
            else:
                await queue.put(None)

        self._pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        ended = 0
        while ended < len(self._pumps):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                ended += 1
            else:
                yield item

    async def aclose(self) -> None:
        """Stops every choice's generation."""
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for stream in self.streams:
            await stream.aclose()


def seeded(request: inference_pb2.GenerateRequest, index: int) -> inference_pb2.GenerateRequest:
    """Choice `index`'s request: the seed plus `index`, among the nonzero seeds (0 stays 0)."""
    choice = inference_pb2.GenerateRequest()
    choice.CopyFrom(request)
    if request.sampling.seed:
        choice.sampling.seed = (request.sampling.seed - 1 + index) % SEEDS + 1
    return choice


def best(choices: list[Messages], n: int, keep_logprobs: bool) -> list[Messages]:
    """The `n` choices with the highest mean log probability per generated token, best first;
    without their log probabilities unless `keep_logprobs` (the client asked for them)."""
    kept = sorted(choices, key=_mean_logprob, reverse=True)[:n]
    for message in (message for messages in kept for message in messages if not keep_logprobs):
        message.ClearField("logprobs")
    return kept


def _mean_logprob(messages: Messages) -> float:
    logprobs = [entry.logprob for message in messages for entry in message.logprobs]
    return math.fsum(logprobs) / len(logprobs) if logprobs else -math.inf


async def _all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """What each of `awaitables` gives, awaited together; on the first error (or a cancel) the
    others are cancelled, and finished, before it is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
