"""Hosts of a test's own network: Linux network namespaces on one subnet, each joined by a veth
pair to a bridge in a namespace of its own (the switch), made with `ip` and deleted afterwards.
A host runs commands (`ip netns exec`), has its link cut and restored, and can offer a service of
this machine's loopback on its own address (PostgreSQL reached over the network, as from another
host). Where namespaces cannot be made (no root, no `ip`), the test is skipped saying why."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.relay import Relay, relaying

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Host:
    """A network namespace with an address on the test's subnet."""

    name: str  # the namespace
    address: str
    switch: str  # the namespace holding the bridge
    port: str  # this host's veth end on the bridge

    @property
    def exec(self) -> tuple[str, ...]:
        """The prefix that runs a command on this host."""
        return ("ip", "netns", "exec", self.name)

    def cut(self) -> None:
        """Its link goes down: nothing reaches the host, nor leaves it (no reset is sent either)."""
        _ip("-n", self.switch, "link", "set", self.port, "down")

    def restore(self) -> None:
        _ip("-n", self.switch, "link", "set", self.port, "up")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@contextlib.contextmanager
def network(
    *names: str, subnet: str = "10.214.0", extra: dict[str, list[str]] | None = None
) -> Iterator[dict[str, Host]]:
    """Hosts `names` at `subnet`.1, .2, ... (and the `extra` addresses given by name), joined by a
    bridge; every namespace is deleted afterwards."""
    suffix = uuid.uuid4().hex[:6]
    switch = f"rf-sw-{suffix}"
    hosts = {
        name: Host(f"rf-{i}-{suffix}", f"{subnet}.{i + 1}", switch, f"rfs{i}{suffix}")
        for i, name in enumerate(names)
    }
    made: list[str] = []
    try:
        try:
            _ip("netns", "add", switch)
            made.append(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for name, host in hosts.items():
                _ip("netns", "add", host.name)
                made.append(host.name)
                _ip("link", "add", "eth0", "netns", host.name, "type", "veth", "peer", "name", host.port,
                    "netns", switch)  # fmt: skip
                _ip("-n", switch, "link", "set", host.port, "master", "br0", "up")
                for address in [host.address, *(extra or {}).get(name, [])]:
                    _ip("-n", host.name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", host.name, "link", "set", "eth0", "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
        except (RuntimeError, FileNotFoundError) as error:
            pytest.skip(f"cannot build network namespaces: {error}")
        yield hosts
    finally:
        for namespace in reversed(made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def listening_socket(host: Host, port: int) -> socket.socket:
    """A TCP socket listening on the host's address, made in its namespace by a thread that enters
    it and ends (a socket keeps the namespace it was made in, whatever thread uses it later)."""

    def make() -> socket.socket:
        libc = ctypes.CDLL(None, use_errno=True)
        with Path(f"/run/netns/{host.name}").open() as namespace:
            if libc.setns(namespace.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {host.name}")
        return socket.create_server((host.address, port))

    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(make).result()


def forwarded(host: Host, port: int, upstream: tuple[str, int]) -> contextlib.AbstractContextManager[Relay]:
    """Connections to host:port are relayed to `upstream` on this machine's loopback, for the
    block: a service of the machine offered on the test's network."""
    return relaying(listening_socket(host, port), upstream)
