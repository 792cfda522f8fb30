"""The egress policy of an isolated worker: where it may connect."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from reflow.addresses import Network, parse_destination


def egress_policy(egress: tuple[str, ...], tracking_uri: str) -> list[tuple[Network, int]]:
    """Destinations a worker may connect to: `egress` (REFLOW_ISOLATION_EGRESS), and the MLflow
    tracking server when it is one (the worker downloads versions from there)."""
    policy = [parse_destination(entry) for entry in egress]
    uri = urlsplit(tracking_uri)
    if uri.scheme in ("http", "https") and uri.hostname:
        port = uri.port or (443 if uri.scheme == "https" else 80)
        for *_, address in socket.getaddrinfo(uri.hostname, port, type=socket.SOCK_STREAM):
            policy.append((ipaddress.ip_network(address[0]), port))
    return policy
