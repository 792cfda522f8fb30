"""Fixtures of the core's tests and the CLI's."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port this process listens on, so that a server asked to bind it cannot."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]
