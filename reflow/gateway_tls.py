"""TLS on the gateway's public port, both faces: its certificate from REFLOW_GATEWAY_TLS_*, and the
credentials of a client that trusts it.

Server-side TLS only: a caller is identified by its API key, not a certificate (certificates
identify gateways and workers to each other, `reflow/mtls.py`). With the files unset both faces
are plaintext, for one machine or behind a proxy that terminates TLS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from reflow.settings import Settings


@dataclass(frozen=True)
class GatewayTls:
    """The gateway's certificate chain and private key (PEM files)."""

    cert: Path
    key: Path

    @classmethod
    def from_settings(cls, settings: Settings) -> GatewayTls | None:
        """REFLOW_GATEWAY_TLS_CERT_FILE and _KEY_FILE; None (plaintext) when they are unset."""
        if not settings.gateway_tls:
            return None
        return cls(Path(settings.gateway_tls_cert_file), Path(settings.gateway_tls_key_file))

    def server_credentials(self) -> grpc.ServerCredentials:
        """The gRPC port's credentials: this certificate, and no client certificate asked for."""
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


def client_credentials(ca_file: str | Path | None) -> grpc.ChannelCredentials | None:
    """A client's credentials toward the gateway: TLS trusting the CA certificate in `ca_file`;
    None (plaintext) when it is empty or None."""
    if not ca_file:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
