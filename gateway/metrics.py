"""Prometheus series of one gateway: latency as clients see it, tokens, requests by status, arm and
tenant."""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reflow.metrics import LATENCY_BUCKETS

OTHER_TENANTS = "(other)"  # the tenant label of every tenant past the bound


class GatewayMetrics:
    """The series a gateway exports, in a registry of its own."""

    def __init__(self, max_tenants: int = 100) -> None:
        self.max_tenants = max_tenants  # REFLOW_METRICS_MAX_TENANTS: the bound on the tenant label
        self._tenants: set[str] = set()
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "reflow_gateway_time_to_first_token_seconds", "Request received to first token sent.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token = Histogram(
            "reflow_gateway_inter_token_seconds", "Between tokens relayed to a client (per token).",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "reflow_gateway_relayed_tokens", "Tokens relayed (rate() = tokens/s).", registry=r
        )
        self.messages = Counter(
            "reflow_gateway_relayed_messages", "Stream messages sent to clients.", registry=r
        )
        self.requests = Counter(
            "reflow_gateway_requests",
            "Finished RPCs by method and gRPC status code.",
            ["method", "code"],
            registry=r,
        )
        self.arms = Counter(
            "reflow_gateway_generations",
            "Generations routed, by model, arm and tenant.",
            ["model", "arm", "tenant"],
            registry=r,
        )
        self.placed = Counter(
            "reflow_gateway_placements",
            'Generations placed, by model and variant ("-" where its workers hold no variants).',
            ["model", "variant"],
            registry=r,
        )
        self.reasoning_lowered = Counter(
            "reflow_gateway_reasoning_budget_lowered",
            "Generations whose reasoning budget was lowered to meet their deadline, by model.",
            ["model"],
            registry=r,
        )
        self.feedback = Counter(
            "reflow_gateway_feedback_items",
            "SubmitFeedback items by outcome (accepted, rejected) and tenant.",
            ["outcome", "tenant"],
            registry=r,
        )
        self.outbox = Gauge(
            "reflow_gateway_outbox_records",
            "Events and feedback waiting in the outbox for Kafka.",
            registry=r,
        )
        self.dead_letters = Gauge(
            "reflow_gateway_dead_letters",
            "Records Kafka refused for good (too large, not authorized), kept in the outbox's dead letters.",
            registry=r,
        )
        self.http_requests = Counter(
            "reflow_gateway_http_requests",
            "Requests to the OpenAI-compatible HTTP API by path and HTTP status.",
            ["path", "status"],
            registry=r,
        )
        self.in_flight = Gauge("reflow_gateway_streams_in_flight", "Generate streams open now.", registry=r)
        self.quota_refusals = Counter(
            "reflow_gateway_quota_refusals",
            "Calls a tenant's quota refused, by quota (streams, requests_per_minute, tokens_per_minute).",
            ["quota"],
            registry=r,
        )
        self.redis_up = Gauge(
            "reflow_gateway_redis_up", "1 while the shared level (REFLOW_REDIS_URL) answers.", registry=r
        )

    def tenant(self, name: str) -> str:
        """The tenant label of tenant `name`: its name for the first `max_tenants` tenants this
        gateway counts, OTHER_TENANTS for the rest, so the series stay bounded however many
        tenants there are."""
        if name in self._tenants:
            return name
        if len(self._tenants) < self.max_tenants:
            self._tenants.add(name)
            return name
        return OTHER_TENANTS

    def count_request(self, method: str, code: grpc.StatusCode) -> None:
        """Called by the error interceptor when an RPC ends."""
        self.requests.labels(method.rsplit("/", 1)[-1], code.name).inc()
