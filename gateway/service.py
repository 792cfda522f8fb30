"""What both faces of the gateway call (the gRPC servicer and the OpenAI HTTP API): a tenant's
generation over quotas, assignment, the relay and the inference log; feedback intake; the models
served. A face only translates its wire format to reflow's messages and back."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from gateway.assignment import ExperimentView
from gateway.auth import Authenticator
from gateway.intake import FeedbackIntake, IntakeResult, Item
from gateway.publishing import InferenceLog
from gateway.quotas import Quotas, estimated_tokens
from gateway.relay import Generation, Relay, deadline_of
from gateway.routing import ModelSpec, ServedVersion, WorkerPool
from gateway.tenants import TenantInfo
from gateway.validation import RequestLimits, check_request
from reflow.errors import InvalidArgument, ReflowError
from reflow.registry import CHALLENGER, CHAMPION, TENANT_ALIAS, tenant_alias
from reflow.request_ids import RequestIds
from reflow.v1 import inference_pb2


class InferenceService:
    """A gateway's calls, whatever face they arrive through."""

    def __init__(
        self,
        *,
        auth: Authenticator,
        quotas: Quotas,
        limits: RequestLimits,
        pool: WorkerPool,
        experiments: ExperimentView,
        relay: Relay,
        log: InferenceLog,
        intake: FeedbackIntake,
        request_ids: RequestIds,
        default_model: ModelSpec,
    ):
        self.auth = auth
        self.quotas = quotas
        self.limits = limits
        self.pool = pool
        self.experiments = experiments
        self.relay = relay
        self.log = log
        self.intake = intake
        self.request_ids = request_ids
        self.default_model = default_model  # what a request that names no model gets

    async def authenticate(self, authorization: str | None, client: str) -> TenantInfo:
        """The tenant whose key the `authorization` header bears; Unauthenticated otherwise, or
        ResourceExhausted while `client` (the caller's address) presented too many unknown keys.
        Each face calls it before it reads a request's body."""
        return await self.auth.authenticate(authorization, client)

    def start(
        self,
        tenant: TenantInfo,
        request: inference_pb2.GenerateRequest,
        time_remaining: float | None = None,
        received: float | None = None,
        beside: Generation | None = None,
    ) -> Generation:
        """A validated request with its id, arm and deadline (`time_remaining`: the call's own, in
        seconds); InvalidArgument for a request a worker should never see. Another choice of the
        request `beside` generates (the same but for its seed) gets that one's arm, and is placed
        beside it (gateway/http/choices.py)."""
        received = time.perf_counter() if received is None else received
        request_id = self.request_ids.new(tenant.name)
        deadline = deadline_of(time_remaining, request.latency_budget_ms, received)
        if beside is not None:  # checked as that one was
            assignment = replace(beside.assignment)  # a copy: each falls back to the champion alone
            return Generation(request, tenant, request_id, assignment, received, deadline, beside=beside)
        check_request(request, self.limits)
        spec = ModelSpec.parse(request.model, self.default_model.name, self.default_model.alias)
        unit = request.user_id or request_id  # what the arm sticks to
        assignment = self.experiments.assign(request.model, spec, tenant, unit, self.pool)
        return Generation(request, tenant, request_id, assignment, received, deadline)

    async def stream(self, generation: Generation) -> AsyncGenerator[inference_pb2.GenerateResponse]:
        """The completion's messages (the first names where it runs, the last how it ended), within
        the tenant's quotas; the finished one is published as an inference event. Close it (or
        cancel its reader) to stop the generation at the worker's next step. Another choice of a
        request is charged its completion: the prompt counts once, as the usage counts it."""
        reserve = estimated_tokens(generation.request, self.limits.default_max_tokens)
        async with self.quotas.admit(generation.tenant, reserve) as charge:
            try:
                # aclosing: cleanup (quota, outstanding counts, the worker call) runs at once on cancel
                stream = self.relay.stream(generation, functools.partial(self.log.finished, generation))
                async with contextlib.aclosing(stream):
                    async for message in stream:
                        # a worker took it: charged the reservation, or what it used once known
                        charge.tokens = charge.reserved
                        if message.HasField("usage"):
                            prompt = message.usage.prompt_tokens if generation.beside is None else 0
                            charge.tokens = prompt + message.usage.completion_tokens
                        yield message
            except ReflowError as error:
                # the error-rate guardrail counts failures of the arm, not a request the model
                # could never take (e.g. a prompt longer than its context)
                if generation.assignment.experiment is not None and not isinstance(error, InvalidArgument):
                    self.log.failed(generation)
                raise

    async def submit_feedback(self, tenant: TenantInfo, items: AsyncIterator[Item]) -> IntakeResult:
        """Validates and durably hands over a tenant's feedback items (FeedbackIntake.submit), a
        request and a stream of the tenant's quotas."""
        async with self.quotas.admit(tenant):
            return await self.intake.submit(tenant.name, items)

    async def close(self) -> None:
        """Stops the background work of its caches (revocations, leases); after both faces stopped."""
        await self.auth.close()
        await self.quotas.close()

    def served_models(self, tenant: TenantInfo | None = None) -> list[tuple[str, list[ServedVersion]]]:
        """Each model the healthy workers serve, by name, with its versions in number order; for
        `tenant`, without other tenants' own versions and aliases (their existence is theirs)."""
        served = self.pool.served_versions()
        if tenant is None:
            return served
        mine = {tenant_alias(tenant.id, CHAMPION), tenant_alias(tenant.id, CHALLENGER)}
        seen = []
        for name, versions in served:
            visible = [
                replace(v, aliases=[a for a in v.aliases if a in mine or not TENANT_ALIAS.fullmatch(a)])
                for v in versions
                if v.tenant in ("", tenant.name)
            ]
            if visible:
                seen.append((name, visible))
        return seen
