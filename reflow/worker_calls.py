"""Calling the running workers from outside the gateway, as the gateway does: which workers
(REFLOW_WORKERS, else those `reflow up` lists in endpoints.json), from the gateway's cgroup
(isolated workers admit no one else), over mTLS when configured, all at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from reflow.cgroups import join_gateway_group
from reflow.endpoints import read_endpoints
from reflow.mtls import TlsFiles, channel_credentials, open_channel
from reflow.settings import Settings
from reflow.v1 import worker_pb2_grpc


@dataclass(frozen=True)
class WorkerTargets:
    """The running workers a command calls, and how: REFLOW_WORKERS, else (looked up at each call:
    a `reflow up` may start after the caller) those of the `reflow up` in `data_dir`; the mTLS
    files; and whether to call from the gateway's cgroup, which isolated workers admit."""

    configured: tuple[str, ...] = ()
    data_dir: Path | None = None
    tls: TlsFiles | None = None
    isolated: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> WorkerTargets:
        """REFLOW_WORKERS, the data dir, REFLOW_TLS_* and REFLOW_ISOLATION."""
        return cls(
            tuple(settings.workers), settings.data_dir, TlsFiles.from_settings(settings),
            settings.isolation != "none",
        )  # fmt: skip

    def addresses(self) -> list[str]:
        """The workers to call now."""
        if self.configured or self.data_dir is None:
            return list(self.configured)
        try:
            return list((read_endpoints(self.data_dir) or {}).get("workers", []))
        except (OSError, ValueError):
            return []


def call_workers(targets: WorkerTargets, method: str, request: Message, timeout_s: float) -> dict[str, Any]:
    """Calls Worker.`method` on every worker in parallel; address -> the response, or the failure
    as "CODE: details" (a str)."""
    addresses = targets.addresses()
    if not addresses:
        return {}
    if targets.isolated and targets.data_dir is not None:
        join_gateway_group(targets.data_dir, create=False)
    credentials = channel_credentials(targets.tls)

    def call(address: str) -> Any:
        with open_channel(address, credentials) as channel:
            try:
                return getattr(worker_pb2_grpc.WorkerStub(channel), method)(request, timeout=timeout_s)
            except grpc.RpcError as error:
                return f"{error.code().name}: {error.details()}"

    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        return dict(zip(addresses, pool.map(call, addresses), strict=True))
