"""uvicorn's httptools protocol, sending a response's head with its body in one write.

uvicorn writes the status line and headers as soon as the app sends
``http.response.start``, then the body in a second write: two ``send`` syscalls and two
TCP segments, so the client wakes twice, for every non-streaming answer and for the first
chunk of every stream. On loopback each costs tens of microseconds of CPU on both ends,
on the cores router, client and engine share. ``HeadWithBody`` holds a head back until
the next write -- the body, in the same step of the app's task on the proxy path -- and
sends both at once; a head followed by nothing is sent on the next turn of the event
loop, and before the transport closes. Order and bytes are unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HeadWithBody", "HttpProtocol"]


class HeadWithBody:
    """A transport that delays a response head until the write after it."""

    __slots__ = ("_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data[:9] == b"HTTP/1.1 " and data[-4:] == b"\r\n\r\n":
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Send a head still held (nothing followed it in its step)."""
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # the rest of the transport, as it is
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """``uvicorn.Config(http=HttpProtocol)``: uvicorn's protocol on ``HeadWithBody``."""

    # uvicorn narrows BaseProtocol's parameter to asyncio.Transport; so does this override.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # HeadWithBody is a Transport by duck typing: what uvicorn calls, the rest delegated.
        super().connection_made(HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
