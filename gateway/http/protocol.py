"""uvicorn's HTTP/1.1 protocol (httptools) with the bounds it lacks on a request's headers: they
must arrive whole within REFLOW_HEADER_TIMEOUT_S of the connection (or of the request's first
byte, on a kept-alive one), and within MAX_HEADER_BYTES, or the connection is closed. uvicorn
times out only idle kept-alive connections, and holds headers of any size: a slow client could
hold a connection for ever, a fast one fill memory, before any key is checked. The rest of a body
a refusal left unread gets the same time."""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.http.errors import error_body

MAX_HEADER_BYTES = 64 * 1024  # the request line and headers; nginx's default is 32 KiB
TOO_LARGE = 431  # Request Header Fields Too Large


class GuardedHttp(HttpToolsProtocol):
    """A connection whose request headers must come within `header_timeout_s` and MAX_HEADER_BYTES."""

    header_timeout_s = 10.0
    _timer: asyncio.TimerHandle | None = None
    _header_bytes = 0

    @classmethod
    def with_timeout(cls, header_timeout_s: float) -> type[GuardedHttp]:
        """This protocol with `header_timeout_s` (uvicorn's Config takes a class)."""
        return type(cls.__name__, (cls,), {"header_timeout_s": header_timeout_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.transport.is_closing():  # refused: the rest is not parsed
            super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._timer is None:  # a kept-alive connection's next request
            self._await_headers()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_done()
        if not self.transport.is_closing():
            super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # answered before its body was read (a refusal): the rest of it, and the next request's
        # headers, come within the timeout too, or the connection is closed (nginx's lingering close)
        if self.cycle.more_body and self._timer is None and not self.transport.is_closing():
            self._await_headers()

    def _await_headers(self) -> None:
        self._timer = self.loop.call_later(self.header_timeout_s, self.transport.close)

    def _headers_done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            message = f"the request line and headers are over {MAX_HEADER_BYTES // 1024} KiB"
            body = json.dumps(error_body(TOO_LARGE, message, "invalid_argument")).encode()
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                + b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
                + body
            )
            self.transport.close()
