"""The egress policy of an isolated worker: where it may connect."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from reflow.settings import Network, Settings, parse_destination


def egress_policy(settings: Settings) -> list[tuple[Network, int]]:
    """Destinations a worker may connect to: REFLOW_ISOLATION_EGRESS, and the MLflow tracking
    server when it is one (it downloads versions from there)."""
    policy = [parse_destination(entry) for entry in settings.isolation_egress]
    uri = urlsplit(settings.resolved_tracking_uri)
    if uri.scheme in ("http", "https") and uri.hostname:
        port = uri.port or (443 if uri.scheme == "https" else 80)
        for *_, address in socket.getaddrinfo(uri.hostname, port, type=socket.SOCK_STREAM):
            policy.append((ipaddress.ip_network(address[0]), port))
    return policy
