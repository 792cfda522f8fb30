"""The streaming relay: a Generate call to a worker serving its arm, the worker's deltas back to the
client, and another worker when one fails before its first token.

When the client reads slower than the worker writes, the deltas that piled up go out as one
message (in order; the first is never held back), so a slow reader costs fewer messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import grpc

from gateway.assignment import Assignment
from gateway.metrics import GatewayMetrics
from gateway.placement import Placement, Placer
from gateway.routing import WorkerHandle, WorkerPool
from gateway.tenants import TenantInfo
from gateway.validation import RequestLimits, worker_request
from reflow.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ReflowError,
    ResourceExhausted,
    Unavailable,
)
from reflow.streaming import Mailbox
from reflow.v1 import inference_pb2, worker_pb2

logger = logging.getLogger(__name__)

CACHE_SALT_KEY = "cache_salt_key"  # the store's secret (reflow/store/secrets.py) cache salts are keyed with
SALT_HEX = 32  # 128 bits of HMAC-SHA256

# header, last message, answer text, reasoning text: called once the last message is ready
OnFinish = Callable[[inference_pb2.GenerateResponse, inference_pb2.GenerateResponse, str, str], None]


@dataclass
class Generation:
    """One Generate call as it is relayed: what was asked, by whom, the arm it got, its clock."""

    request: inference_pb2.GenerateRequest
    tenant: TenantInfo
    request_id: str
    assignment: Assignment
    received: float  # time.perf_counter() when the call arrived
    deadline: float | None  # on the same clock: the call's own, or the latency budget
    # another choice of the same request (gateway/http/choices.py), whose prompt blocks this one reuses
    beside: Generation | None = None
    placement: Placement | None = None  # where the relay runs it, once placed


class Relay:
    """Relays completions from the workers of a pool."""

    def __init__(
        self, pool: WorkerPool, metrics: GatewayMetrics, limits: RequestLimits, placer: Placer, key: bytes
    ):
        self.pool = pool
        self.metrics = metrics
        self.limits = limits
        self.placer = placer
        self.salt_key = key  # CACHE_SALT_KEY, shared by every replica: a tenant's salt is the same on each

    def cache_salt(self, tenant: TenantInfo) -> str:
        """The tenant's prefix-cache salt: its blocks are reused for its requests only, on whichever
        replica they come in, and whoever reaches a worker cannot name it to probe the tenant's
        prompts (`cached_tokens`) without the key."""
        return hmac.digest(self.salt_key, f"tenant {tenant.id}".encode(), "sha256").hex()[:SALT_HEX]

    async def stream(
        self, generation: Generation, on_finish: OnFinish
    ) -> AsyncGenerator[inference_pb2.GenerateResponse]:
        """Streams from a worker, moving to another one if the first fails before any token (or
        back to the same one when it refused a version that its alias has since moved off, as a
        worker frees the old champion before this gateway's next status poll); a challenger gone
        under the request (rolled back) hands it to the champion, in the challenger's arm still."""
        assignment = generation.assignment
        spec = assignment.spec
        tried: set[str] = set()
        full: set[str] = set()  # workers whose queue was full
        near = generation.beside.placement if generation.beside is not None else None
        while True:
            deadline = generation.deadline
            remaining_s = None if deadline is None else max(deadline - time.perf_counter(), 0.001)
            try:
                placement = generation.placement = self.placer.place(
                    spec, generation.request, None if remaining_s is None else remaining_s * 1000,
                    exclude=frozenset(tried), near=near,
                )  # fmt: skip
            except (NotFound, Unavailable):
                if not full and assignment.fall_back_to_champion():
                    spec = assignment.spec
                    tried.clear()
                    continue
                if full:
                    raise ResourceExhausted(
                        f"every worker serving {spec} has a full queue; retry shortly", retry_after_ms=250
                    ) from None
                if not tried:
                    raise
                raise Unavailable(f"every worker serving {spec} failed; retry the request") from None
            worker, loaded, copy = placement.option.worker, placement.option.loaded, placement.option.copy
            if loaded.tenant and loaded.tenant != generation.tenant.name:  # another tenant's own
                raise self.pool.not_served(spec)
            tried.add(worker.address)
            call_request = worker_request(
                generation.request, self.limits, request_id=generation.request_id, loaded=loaded,
                variant=copy.name, reasoning_budget=placement.reasoning_budget,
                cache_salt=self.cache_salt(generation.tenant),  # tenants never share cached blocks
            )  # fmt: skip
            header = inference_pb2.GenerateResponse(
                request_id=generation.request_id,
                model=loaded.model,
                model_version=loaded.version,
                arm=assignment.arm,
                routing=placement.routing(),
            )
            self.metrics.placed.labels(loaded.model, placement.option.variant or "-").inc()
            if placement.reasoning_budget != generation.request.reasoning_budget:
                self.metrics.reasoning_lowered.labels(loaded.model).inc()
            try:
                async with contextlib.aclosing(
                    self._stream_from(placement, call_request, remaining_s, header, generation)
                ) as stream:
                    answer: list[str] = []
                    reasoning: list[str] = []
                    async for message in stream:
                        answer.append(message.text)
                        reasoning.append(message.reasoning_text)
                        if message.finish_reason:  # before the last yield: a client gone now is no loss
                            on_finish(header, message, "".join(answer), "".join(reasoning))
                        yield message
                return
            except _WorkerUnreachable as error:
                if error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self.pool.mark_unhealthy(worker)
                elif error.code == grpc.StatusCode.NOT_FOUND:  # it no longer holds the version
                    await self.pool.refresh_one(worker)
                    now = worker.serves(spec)
                    if now is not None and now.version != loaded.version:  # the alias moved: ask again
                        tried.discard(worker.address)
                else:
                    full.add(worker.address)
                logger.warning(
                    "request_id=%s worker %s answered %s before the first token; trying another",
                    generation.request_id, worker.address, error.code.name,
                )  # fmt: skip

    async def _stream_from(
        self,
        placement: Placement,
        call_request: worker_pb2.WorkerGenerateRequest,
        remaining_s: float | None,
        header: inference_pb2.GenerateResponse,
        generation: Generation,
    ) -> AsyncGenerator[inference_pb2.GenerateResponse]:
        """Relays one worker stream; when the client reads slower than the worker writes, the
        deltas that piled up go out as one message (in order; the first is never held back). The
        worker's load counts it while it runs, and the latency model learns from it when it ends
        (Placer.start)."""
        worker = placement.option.worker
        tracked = self.placer.start(placement)
        usage: inference_pb2.Usage | None = None  # once it finished
        call = worker.stub.Generate(call_request, timeout=remaining_s)
        mailbox: Mailbox[worker_pb2.WorkerGenerateResponse] = Mailbox(merge_worker_deltas)
        reader = asyncio.create_task(_pump(call, mailbox), name=f"relay-{header.request_id}")
        self.metrics.in_flight.inc()
        first_token_at: float | None = None
        received = last_sent = generation.received
        try:
            while True:
                try:
                    delta = await mailbox.get()
                except grpc.aio.AioRpcError as error:
                    raise _worker_error(worker, error, started=first_token_at is not None) from None
                message = inference_pb2.GenerateResponse(
                    text=delta.text, reasoning_text=delta.reasoning_text, logprobs=delta.logprobs,
                    prompt_logprobs=delta.prompt_logprobs, tool_calls=delta.tool_calls,
                )  # fmt: skip
                now = time.perf_counter()
                tracked.tokens_arrived(len(delta.token_ids), now)
                later_tokens = len(delta.token_ids)  # tokens after the first one of the stream
                if first_token_at is None:
                    first_token_at = now
                    message.MergeFrom(header)
                    self.metrics.ttft.observe(now - received)
                    tenant = self.metrics.tenant(generation.tenant.name)
                    self.metrics.arms.labels(header.model, header.arm, tenant).inc()
                    later_tokens -= 1
                for _ in range(later_tokens):  # a coalesced message spreads its gap over its tokens
                    self.metrics.inter_token.observe((now - last_sent) / max(later_tokens, 1))
                last_sent = now
                self.metrics.tokens.inc(len(delta.token_ids))
                self.metrics.messages.inc()
                if delta.finish_reason:
                    message.finish_reason = delta.finish_reason
                    message.usage.CopyFrom(
                        inference_pb2.Usage(
                            prompt_tokens=delta.prompt_tokens,
                            completion_tokens=delta.completion_tokens,
                            reasoning_tokens=delta.reasoning_tokens,
                            cached_tokens=delta.cached_tokens,
                            time_to_first_token_ms=(first_token_at - received) * 1000,
                            total_ms=(now - received) * 1000,
                        )
                    )
                    logger.info(
                        "request_id=%s model=%s model_version=%s arm=%s finish=%s tokens=%d total_ms=%.1f",
                        header.request_id, header.model, header.model_version, header.arm,
                        inference_pb2.FinishReason.Name(delta.finish_reason),
                        delta.completion_tokens, message.usage.total_ms,
                    )  # fmt: skip
                    usage = message.usage
                    yield message
                    return
                yield message
        finally:
            tracked.close(usage)
            self.metrics.in_flight.dec()
            reader.cancel()
            call.cancel()  # no-op when finished; stops the worker when the client went away


def deadline_of(time_remaining: float | None, latency_budget_ms: int, received: float) -> float | None:
    """The stream's deadline on the perf_counter clock: the call's own or the latency budget."""
    limits = [received + latency_budget_ms / 1000] if latency_budget_ms else []
    if time_remaining is not None:
        limits.append(time.perf_counter() + time_remaining)
    return min(limits, default=None)


def merge_worker_deltas(
    earlier: worker_pb2.WorkerGenerateResponse, later: worker_pb2.WorkerGenerateResponse
) -> None:
    """Folds a later worker delta into an earlier one that has not been relayed yet."""
    earlier.token_ids.extend(later.token_ids)
    earlier.logprobs.extend(later.logprobs)
    earlier.prompt_logprobs.extend(later.prompt_logprobs)
    earlier.text += later.text
    earlier.reasoning_text += later.reasoning_text
    for piece in later.tool_calls:  # a call's arguments continued: one piece
        calls = earlier.tool_calls
        if calls and calls[-1].index == piece.index and not piece.id:
            calls[-1].arguments += piece.arguments
        else:
            calls.append(piece)
    if later.finish_reason:
        earlier.finish_reason = later.finish_reason
        earlier.prompt_tokens = later.prompt_tokens
        earlier.completion_tokens = later.completion_tokens
        earlier.reasoning_tokens = later.reasoning_tokens
        earlier.cached_tokens = later.cached_tokens


async def _pump(call: grpc.aio.UnaryStreamCall, mailbox: Mailbox[worker_pb2.WorkerGenerateResponse]) -> None:
    """Reads a worker stream as fast as it comes into `mailbox`; always ends it with a failure
    the reader sees after the last item (it stops reading at the final delta before that)."""
    failure: BaseException = Unavailable(
        "the worker ended the stream without finishing it; retry the request"
    )
    try:
        async for delta in call:
            mailbox.put(delta)
    except grpc.aio.AioRpcError as error:
        failure = error
    except asyncio.CancelledError:
        raise
    except Exception as error:
        logger.exception("relay from worker failed")
        failure = Unavailable(f"relaying from the worker failed ({type(error).__name__}); retry the request")
    finally:
        mailbox.fail(failure)


# Worker answers that, before the first token, send the request to another worker: it is down
# or shutting down (UNAVAILABLE, CANCELLED), no longer holds the version, or its queue is full.
RETRY_ON_ANOTHER_WORKER = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class _WorkerUnreachable(Exception):
    """The worker failed before sending a token; another worker may take the request."""

    def __init__(self, code: grpc.StatusCode):
        super().__init__(code.name)
        self.code = code


def _worker_error(worker: WorkerHandle, error: grpc.aio.AioRpcError, *, started: bool) -> Exception:
    code = error.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(
            "the completion did not finish within the call deadline or latency_budget_ms; "
            "raise them or lower max_tokens"
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # e.g. a prompt longer than the model's context
        return InvalidArgument(error.details() or code.name)
    if not started and code in RETRY_ON_ANOTHER_WORKER:
        return _WorkerUnreachable(code)
    if started:
        return Unavailable(f"worker {worker.address} failed mid-stream ({code.name}); retry the request")
    return ReflowError(f"worker {worker.address} failed ({code.name}): {error.details()}")
