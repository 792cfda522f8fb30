"""A TLS-terminating TCP proxy: clients speak TLS to it, with a certificate signed by the CA it is
given, and it relays the plain bytes to a backend. It puts TLS in front of the embedded Kafka
broker, which has none of its own (started advertising the proxy's address, so clients reach it
through the proxy only)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


class TlsProxy:
    """Listens on a free loopback port in a thread of its own until closed."""

    def __init__(
        self, backend_port: Callable[[], int], cert_file: Path, key_file: Path, client_ca_file: Path
    ):
        """`backend_port` says where to relay each connection (a broker's port may change as it
        starts); the clients' certificates must be signed by `client_ca_file` (mutual TLS)."""
        self.backend_port = backend_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert_file, key_file)
        self.context.load_verify_locations(client_ca_file)
        self.context.verify_mode = ssl.CERT_REQUIRED
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-proxy", daemon=True)
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self.context))
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs `coroutine` in the proxy's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _relay(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        try:
            backend, to_backend = await asyncio.open_connection("127.0.0.1", self.backend_port())
        except OSError:  # the backend is down: as if the proxy were
            to_client.close()
            return
        await asyncio.gather(_pipe(client, to_backend), _pipe(backend, to_client))

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> TlsProxy:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """Copies `source` to `sink` until either side closes; then closes `sink`."""
    try:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        sink.close()
