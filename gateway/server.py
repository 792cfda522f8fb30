"""The public Inference service: authenticate, validate, route, relay the worker's token stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from kafka.errors import KafkaError
from pydantic import ValidationError

from feedback.bus.kafka import ensure_topics, resolve_bootstrap
from feedback.bus.publisher import Publisher
from feedback.events import (
    InferenceEvent,
    InvalidFeedback,
    Latency,
    Record,
    TokenUsage,
    feedback_event,
    require_served,
    storable,
)
from gateway.assignment import Assignment, ExperimentView
from gateway.auth import Authenticator
from gateway.metrics import GatewayMetrics
from gateway.quotas import Quotas
from gateway.routing import ModelSpec, WorkerHandle, WorkerPool
from gateway.tenants import TenantInfo
from gateway.validation import check_request, worker_request
from reflow.cgroups import join_gateway_group
from reflow.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ReflowError,
    ResourceExhausted,
    Unavailable,
)
from reflow.mtls import channel_credentials
from reflow.registry import CHALLENGER
from reflow.request_ids import RequestIds
from reflow.serving import (
    bind,
    host_port,
    new_server,
    set_serving,
    start_metrics_server,
    wait_for_signal,
    write_ready_file,
)
from reflow.settings import Settings
from reflow.store.database import open_engine, require_current_schema
from reflow.store.tables import utcnow
from reflow.streaming import Mailbox
from reflow.v1 import inference_pb2, inference_pb2_grpc, worker_pb2

logger = logging.getLogger(__name__)
FEEDBACK_CHUNK = 500  # SubmitFeedback items handed over to Kafka together
CHUNKS_IN_FLIGHT = 4  # chunks of one stream being handed over while more are read
MAX_LISTED_ERRORS = 1000  # rejected items listed one by one in a FeedbackAck; the rest are counted
SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Streams completions (publishing an event for each), takes feedback on them, lists models."""

    def __init__(
        self,
        settings: Settings,
        auth: Authenticator,
        quotas: Quotas,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        request_ids: RequestIds,
        publisher: Publisher,
        experiments: ExperimentView,
    ):
        self.settings = settings
        self.auth = auth
        self.quotas = quotas
        self.pool = pool
        self.metrics = metrics
        self.request_ids = request_ids
        self.publisher = publisher
        self.experiments = experiments

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        received = time.perf_counter()
        tenant = await self.auth.authenticate(context)
        check_request(request, self.settings)
        spec = ModelSpec.parse(request.model, self.settings.model_name, self.settings.model_alias)
        request_id = self.request_ids.new(tenant.name)
        await context.send_initial_metadata((("x-request-id", request_id),))
        deadline = _deadline(context.time_remaining(), request.latency_budget_ms, received)
        assignment = self.experiments.assign(request.model, spec, request.user_id or request_id, self.pool)
        with self.quotas.admit(tenant):
            try:
                # aclosing: cleanup (quota, outstanding counts, the worker call) runs at once on cancel
                async with contextlib.aclosing(
                    self._relay(request, tenant, assignment, request_id, deadline, received)
                ) as relay:
                    async for message in relay:
                        yield message
            except ReflowError as error:
                # the error-rate guardrail counts failures of the arm, not a request the model
                # could never take (e.g. a prompt longer than its context)
                if assignment.experiment is not None and not isinstance(error, InvalidArgument):
                    self._publish_failure(request, tenant, request_id, assignment, received)
                raise

    async def _relay(
        self,
        request: inference_pb2.GenerateRequest,
        tenant: TenantInfo,
        assignment: Assignment,
        request_id: str,
        deadline: float | None,
        received: float,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Streams from a worker, moving to another one if the first fails before any token."""
        spec = assignment.spec
        tried: set[str] = set()
        full: set[str] = set()  # workers whose queue was full
        while True:
            try:
                worker, loaded = self.pool.route(spec, exclude=frozenset(tried))
            except (NotFound, Unavailable):
                if assignment.experiment is not None and assignment.arm == CHALLENGER and not full:
                    assignment.fall_back_to_champion()
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
            tried.add(worker.address)
            call_request = worker_request(request, self.settings, request_id=request_id, loaded=loaded)
            header = inference_pb2.GenerateResponse(
                request_id=request_id, model=loaded.model, model_version=loaded.version, arm=assignment.arm
            )
            remaining_s = None if deadline is None else max(deadline - time.perf_counter(), 0.001)
            try:
                async with contextlib.aclosing(
                    self._stream_from(worker, call_request, remaining_s, header, received)
                ) as stream:
                    answer: list[str] = []
                    reasoning: list[str] = []
                    async for message in stream:
                        answer.append(message.text)
                        reasoning.append(message.reasoning_text)
                        if message.finish_reason:  # before the last yield: a client gone now is no loss
                            self._publish_inference(
                                request, tenant, header, assignment, message, "".join(answer),
                                "".join(reasoning),
                            )  # fmt: skip
                        yield message
                return
            except _WorkerUnreachable as error:
                if error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self.pool.mark_unhealthy(worker)
                elif error.code == grpc.StatusCode.NOT_FOUND:  # it no longer holds the version
                    await self.pool.refresh_one(worker)
                else:
                    full.add(worker.address)
                logger.warning(
                    "request_id=%s worker %s answered %s before the first token; trying another",
                    request_id, worker.address, error.code.name,
                )  # fmt: skip

    async def _stream_from(
        self,
        worker: WorkerHandle,
        call_request: worker_pb2.WorkerGenerateRequest,
        remaining_s: float | None,
        header: inference_pb2.GenerateResponse,
        received: float,
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Relays one worker stream; when the client reads slower than the worker writes, the
        deltas that piled up go out as one message (in order; the first is never held back)."""
        call = worker.stub.Generate(call_request, timeout=remaining_s)
        mailbox: Mailbox[worker_pb2.WorkerGenerateResponse] = Mailbox(merge_worker_deltas)
        reader = asyncio.create_task(_pump(call, mailbox), name=f"relay-{header.request_id}")
        worker.outstanding += 1
        self.metrics.in_flight.inc()
        first_token_at: float | None = None
        last_sent = received
        try:
            while True:
                try:
                    delta = await mailbox.get()
                except grpc.aio.AioRpcError as error:
                    raise _worker_error(worker, error, started=first_token_at is not None) from None
                message = inference_pb2.GenerateResponse(text=delta.text, reasoning_text=delta.reasoning_text)
                now = time.perf_counter()
                later_tokens = len(delta.token_ids)  # tokens after the first one of the stream
                if first_token_at is None:
                    first_token_at = now
                    message.MergeFrom(header)
                    self.metrics.ttft.observe(now - received)
                    self.metrics.arms.labels(header.model, header.arm).inc()
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
                    yield message
                    return
                yield message
        finally:
            worker.outstanding -= 1
            self.metrics.in_flight.dec()
            reader.cancel()
            call.cancel()  # no-op when finished; stops the worker when the client went away

    def _publish_inference(
        self,
        request: inference_pb2.GenerateRequest,
        tenant: TenantInfo,
        header: inference_pb2.GenerateResponse,
        assignment: Assignment,
        last: inference_pb2.GenerateResponse,
        answer: str,
        reasoning: str,
    ) -> None:
        """Hands the event of a finished generation to the publisher, off the request path."""
        usage = last.usage
        self._publish(
            request, tenant, header, assignment,
            finish_reason=inference_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_"),
            usage=TokenUsage(
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                reasoning_tokens=usage.reasoning_tokens,
            ),
            latency=Latency(first_token_ms=usage.time_to_first_token_ms, total_ms=usage.total_ms),
            answer=answer, reasoning=reasoning,
        )  # fmt: skip

    def _publish_failure(
        self,
        request: inference_pb2.GenerateRequest,
        tenant: TenantInfo,
        request_id: str,
        assignment: Assignment,
        received: float,
    ) -> None:
        """Hands over the event of a failed request of an experiment, on the version of its arm."""
        experiment = assignment.experiment
        assert experiment is not None
        version = (
            experiment.challenger_version if assignment.arm == CHALLENGER else experiment.champion_version
        )
        header = inference_pb2.GenerateResponse(
            request_id=request_id, model=experiment.model, model_version=version, arm=assignment.arm
        )
        elapsed_ms = (time.perf_counter() - received) * 1000
        self._publish(
            request, tenant, header, assignment, finish_reason="ERROR",
            usage=TokenUsage(prompt_tokens=0, completion_tokens=0, reasoning_tokens=0),
            latency=Latency(first_token_ms=elapsed_ms, total_ms=elapsed_ms),
        )  # fmt: skip

    def _publish(
        self,
        request: inference_pb2.GenerateRequest,
        tenant: TenantInfo,
        header: inference_pb2.GenerateResponse,
        assignment: Assignment,
        *,
        finish_reason: str,
        usage: TokenUsage,
        latency: Latency,
        answer: str = "",
        reasoning: str = "",
    ) -> None:
        """Publishes an inference event; a completion is never failed because its event could
        not be made (that is logged)."""
        experiment = assignment.experiment
        try:
            event = InferenceEvent(
                request_id=header.request_id, tenant=tenant.name, user_id=storable(request.user_id),
                model=header.model, version=header.model_version, arm=header.arm,
                experiment=experiment.id if experiment is not None else None,
                prompt=storable(request.prompt), reasoning=storable(reasoning), completion=storable(answer),
                finish_reason=finish_reason, usage=usage, latency=latency, time=utcnow(),
            )  # fmt: skip
        except ValidationError:
            logger.exception("request_id=%s: no inference event could be made", header.request_id)
            return
        self.publisher.enqueue(event.to_record())

    async def SubmitFeedback(
        self, request_iterator: AsyncIterator[inference_pb2.Feedback], context: grpc.aio.ServicerContext
    ) -> inference_pb2.FeedbackAck:
        """Validates each item, hands the valid ones over durably in chunks, then acknowledges.

        Chunks are handed over while the next ones are read (at most CHUNKS_IN_FLIGHT at once),
        so reading the stream does not stop for Kafka's acks.
        """
        tenant = await self.auth.authenticate(context)
        ack = inference_pb2.FeedbackAck()
        first_error: InvalidFeedback | None = None
        chunk: list[Record] = []
        handovers: set[asyncio.Task[int]] = set()
        index = -1
        async for item in request_iterator:
            index += 1
            fields = {
                "feedback_id": item.feedback_id, "request_id": item.request_id, "rating": item.rating,
                "correction": item.correction, "user_id": item.user_id, "labels": dict(item.labels),
            }  # fmt: skip
            try:
                event = require_served(feedback_event(tenant.name, fields, utcnow()), self.request_ids)
            except InvalidFeedback as error:
                first_error = first_error or error
                ack.rejected += 1
                if len(ack.errors) < MAX_LISTED_ERRORS:
                    ack.errors.add(
                        index=index, feedback_id=item.feedback_id, reason=str(error), code=error.code
                    )
                continue
            chunk.append(event.to_record())
            if len(chunk) >= FEEDBACK_CHUNK:
                handovers.add(asyncio.create_task(self._hand_over(chunk)))
                chunk = []
                if len(handovers) >= CHUNKS_IN_FLIGHT:
                    done, handovers = await asyncio.wait(handovers, return_when=asyncio.FIRST_COMPLETED)
                    if any(task.exception() for task in done):
                        await asyncio.gather(*handovers, return_exceptions=True)
                    ack.accepted += sum(task.result() for task in done)
        if chunk:
            handovers.add(asyncio.create_task(self._hand_over(chunk)))
        outcomes = await asyncio.gather(*handovers, return_exceptions=True)  # every task ends first
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        ack.accepted += sum(outcomes)  # type: ignore[arg-type]
        self.metrics.feedback.labels("accepted").inc(ack.accepted)
        self.metrics.feedback.labels("rejected").inc(ack.rejected)
        if first_error is not None and ack.accepted == 0:  # nothing taken: fail like a unary call would
            error_type = PermissionDenied if first_error.code == "PERMISSION_DENIED" else InvalidArgument
            more = f" ({ack.rejected - 1} more item(s) rejected too)" if ack.rejected > 1 else ""
            raise error_type(f"item {ack.errors[0].index}: {first_error}{more}")
        return ack

    async def _hand_over(self, chunk: list[Record]) -> int:
        """Publishes `chunk` durably (Kafka or the outbox); returns how many records that was."""
        try:
            await asyncio.to_thread(self.publisher.publish, chunk)
        except Exception as error:  # neither Kafka nor the outbox took it (a full disk?)
            logger.exception("feedback handover failed")
            raise Unavailable(
                f"feedback could not be stored ({type(error).__name__}); retry the stream: "
                "items with the same feedback_id are stored once"
            ) from error
        return len(chunk)

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        await self.auth.authenticate(context)
        response = inference_pb2.ListModelsResponse()
        for name, versions in sorted(self.pool.served_versions().items()):
            model = response.models.add(name=name)
            for version, (aliases, ready) in sorted(versions.items(), key=lambda kv: int(kv[0])):
                model.versions.add(version=version, aliases=sorted(aliases), ready_workers=ready)
        return response


def _deadline(time_remaining: float | None, latency_budget_ms: int, received: float) -> float | None:
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
    earlier.text += later.text
    earlier.reasoning_text += later.reasoning_text
    if later.finish_reason:
        earlier.finish_reason = later.finish_reason
        earlier.prompt_tokens = later.prompt_tokens
        earlier.completion_tokens = later.completion_tokens
        earlier.reasoning_tokens = later.reasoning_tokens


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


async def create_server(
    settings: Settings, pool: WorkerPool, metrics: GatewayMetrics, publisher: Publisher
) -> tuple[grpc.aio.Server, int, object]:
    """A started gateway on the configured host and port; returns (server, port, health servicer)."""
    engine = open_engine(settings.resolved_database_url)
    require_current_schema(engine)
    auth = Authenticator(engine, settings.auth_cache_ttl_s)
    request_ids = RequestIds.from_store(engine)
    experiments = ExperimentView(engine, settings.worker_poll_s)
    await experiments.refresh()
    servicer = InferenceServicer(settings, auth, Quotas(), pool, metrics, request_ids, publisher, experiments)
    metrics.outbox.set_function(lambda: publisher.pending)
    server, health_servicer = new_server([SERVICE], on_done=metrics.count_request)
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = bind(server, settings.gateway_host, settings.gateway_port)
    await pool.start()
    await server.start()
    await set_serving(health_servicer, [SERVICE], True)
    return server, port, health_servicer


async def serve(settings: Settings, *, ready_file: Path | None = None) -> None:
    """`reflow gateway`: serve until SIGINT/SIGTERM, then drain in-flight streams."""
    if not settings.workers:
        raise ReflowError("no workers configured; set REFLOW_WORKERS=host:port[,host:port]")
    # first, so every socket it makes is the gateway's
    if settings.isolation != "none" and join_gateway_group(settings.data_dir):
        logger.info("gateway in the cgroup isolated workers admit")
    bootstrap = resolve_bootstrap(settings)
    try:
        await asyncio.to_thread(ensure_topics, bootstrap, settings.kafka_partitions)
    except KafkaError as error:  # serve anyway: events wait in the outbox until Kafka answers
        logger.warning("could not reach Kafka at %s (%s); events go to the outbox for now", bootstrap, error)
    publisher = Publisher(bootstrap, settings.outbox_path, settings.kafka_handover_timeout_s)
    pool = WorkerPool(settings.workers, settings.worker_poll_s, channel_credentials(settings))
    metrics = GatewayMetrics()
    server, port, health_servicer = await create_server(settings, pool, metrics, publisher)
    metrics_server, metrics_url = start_metrics_server(
        metrics.registry, settings.gateway_host, settings.gateway_metrics_port
    )
    address = host_port(settings.gateway_host, port)
    logger.info("gateway serving on %s, workers %s, metrics %s", address, settings.workers, metrics_url)
    write_ready_file(ready_file, address=address, metrics=metrics_url)
    await wait_for_signal()
    logger.info("gateway draining (grace %.0fs)", settings.shutdown_grace_s)
    await set_serving(health_servicer, [SERVICE], False)
    with contextlib.suppress(asyncio.CancelledError):
        await server.stop(settings.shutdown_grace_s)
    await pool.close()
    await asyncio.to_thread(publisher.close, settings.shutdown_grace_s)
    metrics_server.shutdown()
