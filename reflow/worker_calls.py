"""Calling the running workers from outside the gateway, as the gateway does: which workers
(REFLOW_WORKERS, else those `reflow up` lists in endpoints.json), from the gateway's cgroup
(isolated workers admit no one else), over mTLS when configured, all at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import Message

from reflow.cgroups import join_gateway_group
from reflow.endpoints import read_endpoints
from reflow.mtls import channel_credentials, open_channel
from reflow.settings import Settings
from reflow.v1 import worker_pb2_grpc


def worker_addresses(settings: Settings) -> list[str]:
    """REFLOW_WORKERS, else the workers of a running `reflow up` in this data dir."""
    if settings.workers:
        return settings.workers
    try:
        return list((read_endpoints(settings.data_dir) or {}).get("workers", []))
    except (OSError, ValueError):
        return []


def call_workers(settings: Settings, method: str, request: Message, timeout_s: float) -> dict[str, Any]:
    """Calls Worker.`method` on every worker in parallel; address -> the response, or the failure
    as "CODE: details" (a str)."""
    addresses = worker_addresses(settings)
    if not addresses:
        return {}
    if settings.isolation != "none":
        join_gateway_group(settings.data_dir, create=False)
    credentials = channel_credentials(settings)

    def call(address: str) -> Any:
        with open_channel(address, credentials) as channel:
            try:
                return getattr(worker_pb2_grpc.WorkerStub(channel), method)(request, timeout=timeout_s)
            except grpc.RpcError as error:
                return f"{error.code().name}: {error.details()}"

    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        return dict(zip(addresses, pool.map(call, addresses), strict=True))
