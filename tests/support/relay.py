"""A TCP relay run by a test: connections to its listening socket are forwarded to an upstream
address, until it is cut (bytes are held both ways and nothing is reset, as when a link goes down)
and restored."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class Relay:
    """Relays each connection accepted on `server` to `upstream`, on threads of its own."""

    def __init__(self, server: socket.socket, upstream: tuple[str, int]):
        self.server, self.upstream = server, upstream
        self.flowing = threading.Event()  # clear: the link is cut
        self.flowing.set()
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def address(self) -> str:
        host, port = self.server.getsockname()[:2]
        return f"{host}:{port}"

    def cut(self) -> None:
        self.flowing.clear()

    def restore(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        """Stops accepting; the connections relayed finish as their ends close."""
        self.restore()
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self._accepting.join(10)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(self.upstream) as service:
            sending = threading.Thread(target=self._pump, args=(client, service), daemon=True)
            sending.start()
            self._pump(service, client)
            sending.join()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self.flowing.wait()  # a cut link holds what it got
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def relaying(server: socket.socket, upstream: tuple[str, int]) -> Iterator[Relay]:
    """A relay from `server` (a listening socket, closed afterwards) to `upstream`, for the block."""
    relay = Relay(server, upstream)
    try:
        yield relay
    finally:
        relay.close()
