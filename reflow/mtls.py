"""Mutual TLS between the gateway and its workers: credentials from REFLOW_TLS_* files.

Across hosts the gateway's cgroup cannot vouch for it, so isolation's address allow-list is the
first layer and mTLS the second: a worker accepts only clients whose certificate the CA signed,
and the gateway (or a control command) checks the worker's certificate the same way. With the
files unset the channel is plaintext, for one machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from reflow.settings import Settings


@dataclass(frozen=True)
class TlsFiles:
    """The CA that signs gateway and worker certificates, and this process's certificate and key."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_settings(cls, settings: Settings) -> TlsFiles | None:
        """REFLOW_TLS_CA_FILE, _CERT_FILE and _KEY_FILE; None (plaintext) when they are unset."""
        if not settings.tls:
            return None
        return cls(Path(settings.tls_ca_file), Path(settings.tls_cert_file), Path(settings.tls_key_file))


def server_credentials(tls: TlsFiles | None) -> grpc.ServerCredentials | None:
    """A worker's credentials: its certificate, and client certificates required."""
    if tls is None:
        return None
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=tls.ca.read_bytes(),
        require_client_auth=True,
    )


def channel_credentials(tls: TlsFiles | None) -> grpc.ChannelCredentials | None:
    """A client's credentials toward workers: the CA to trust and its own certificate."""
    if tls is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(),
        private_key=tls.key.read_bytes(),
        certificate_chain=tls.cert.read_bytes(),
    )


# While a call is open the channel pings its peer every 10 s, and ends its calls with UNAVAILABLE
# when a ping goes unanswered for 5 s: a worker whose host hangs or whose link is cut (no reset
# arrives; TCP alone would wait for minutes) fails its streams, and a request that had no token yet
# moves to another worker. Servers accept these pings (reflow.serving.PING_POLICY).
KEEPALIVE = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),  # what gRPC 1.85 waits for the ack (else 60 s)
    ("grpc.http2.max_pings_without_data", 0),  # a long answer sends the client no data: keep pinging
)


def open_channel(address: str, credentials: grpc.ChannelCredentials | None, api: Any = grpc) -> Any:
    """A channel of `api` (grpc, or grpc.aio) to a worker, or to the gateway with the credentials
    of `reflow.gateway_tls`: plaintext, or TLS with `credentials`; it pings its peer (KEEPALIVE)."""
    if credentials is None:
        return api.insecure_channel(address, options=KEEPALIVE)
    return api.secure_channel(address, credentials, options=KEEPALIVE)
