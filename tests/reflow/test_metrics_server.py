"""The Prometheus endpoint every gateway and worker runs: a scrape answers, and a flood of idle
connections holds at most 16 threads, the next connection closed at once; a freed slot serves again."""

from __future__ import annotations

import contextlib
import socket
import urllib.request
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter

from reflow.serving import MAX_METRICS_CONNECTIONS, start_metrics_server
from tests.support.waiting import wait_for

SCRAPE = b"GET /metrics HTTP/1.0\r\n\r\n"


@contextlib.contextmanager
def metrics_server() -> Iterator[tuple[str, int]]:
    """A metrics server on a free loopback port, serving one counter; yields (url, port)."""
    registry = CollectorRegistry()
    Counter("reflow_test_scrapes", "A series to find in a scrape.", registry=registry).inc()
    server, url = start_metrics_server(registry, "127.0.0.1", 0)
    try:
        yield url, server.server_port
    finally:
        server.shutdown()
        server.server_close()


def scraped(port: int) -> bytes:
    """What one connection that asks for /metrics reads back (empty when it was closed unanswered)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        connection.sendall(SCRAPE)
        received = b""
        try:
            while chunk := connection.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def test_a_scrape_answers_with_the_registry() -> None:
    with metrics_server() as (url, _), urllib.request.urlopen(url, timeout=30) as reply:
        assert b"reflow_test_scrapes_total 1.0" in reply.read()


def test_connections_past_the_bound_are_closed_and_a_freed_slot_serves_again() -> None:
    with metrics_server() as (_, port), contextlib.ExitStack() as held:
        idle = [
            held.enter_context(socket.create_connection(("127.0.0.1", port), timeout=30))
            for _ in range(MAX_METRICS_CONNECTIONS)
        ]  # each holds a thread, waiting for a request that never comes
        assert scraped(port) == b""  # the 17th: closed unanswered, no thread of its own
        idle[0].close()
        answer = wait_for(lambda: scraped(port), what="a scrape once a slot is free")
        assert answer.startswith(b"HTTP/1.0 200") and b"reflow_test_scrapes_total 1.0" in answer
