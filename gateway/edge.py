"""What each public face (gRPC and HTTP) grants a caller before its key is checked, and at most
after: the bounds that keep a flood of requests from costing memory (REFLOW_MAX_REQUEST_BYTES and
its neighbours)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.tenants import TenantInfo

# How a face checks a caller: (the `authorization` header, the client's address) -> its tenant
Authenticate = Callable[[str | None, str], Awaitable[TenantInfo]]


@dataclass(frozen=True)
class EdgeLimits:
    """Bounds of the public faces; the defaults are the settings'."""

    max_request_bytes: int = 2**20  # an HTTP body, a gRPC message (each of a stream's)
    max_concurrent_requests: int = 1024  # per face; past it refused, not queued
    header_timeout_s: float = 10.0  # for an HTTP request's headers to arrive whole
    auth_failures_per_minute: int = 60  # unknown keys one client address may present
