"""Mutual TLS between the gateway and its workers: credentials from REFLOW_TLS_* files.

Across hosts the gateway's cgroup cannot vouch for it, so isolation's address allow-list is the
first layer and mTLS the second: a worker accepts only clients whose certificate the CA signed,
and the gateway (or a control command) checks the worker's certificate the same way. With the
files unset the channel is plaintext, for one machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from reflow.settings import Settings


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """A worker's credentials: its certificate, and client certificates required."""
    if not settings.tls:
        return None
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key_file), _read(settings.tls_cert_file))],
        root_certificates=_read(settings.tls_ca_file),
        require_client_auth=True,
    )


def channel_credentials(settings: Settings) -> grpc.ChannelCredentials | None:
    """A client's credentials toward workers: the CA to trust and its own certificate."""
    if not settings.tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(settings.tls_ca_file),
        private_key=_read(settings.tls_key_file),
        certificate_chain=_read(settings.tls_cert_file),
    )


def open_channel(address: str, credentials: grpc.ChannelCredentials | None, api: Any = grpc) -> Any:
    """A channel of `api` (grpc, or grpc.aio) to a worker: plaintext, or TLS with `credentials`."""
    if credentials is None:
        return api.insecure_channel(address)
    return api.secure_channel(address, credentials)
