"""A pooled keep-alive HTTP/1.1 client for the forwarding hot path, on asyncio protocols
and httptools' response parser.

Why not aiohttp or httpx: per forward, aiohttp spent ~0.1 ms of CPU in its request
machinery (timers, tracing hooks, header multidicts) and httpx ~1 ms; this client writes
the request in one ``write`` (head + body, the client's header bytes as received) and
hands body chunks over as they arrive, nothing else. What it needs to do is small: POST,
one response at a time per connection, Content-Length / chunked / close-delimited bodies
(httptools decodes chunking), reading paused when the consumer lags (1 MiB buffered).

Errors say what the forwarder must know: :class:`ConnectRefused` (the engine is down: it
counts against health), :class:`Dropped` (the connection went away before the answer was
complete: a pooled connection the engine closed as idle earns one more try),
``TimeoutError``. Idle connections are dropped after ``keepalive_s`` (2 s), before the
engines drop theirs (uvicorn, hence vLLM, after 5 s).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = ["ConnectRefused", "Dropped", "UpstreamError", "UpstreamPool", "UpstreamResponse"]

_HIGH_WATER = 1 << 20


class UpstreamError(Exception):
    """The upstream could not give a (complete) answer."""


class ConnectRefused(UpstreamError):
    """Could not connect: the instance is down (or not there)."""


class Dropped(UpstreamError):
    """The connection closed before the answer was complete."""


class _Conn(asyncio.Protocol):
    """One connection; serves one request at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.resp: UpstreamResponse | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # never asked for; treat as garbage
            self._fail(Dropped("unexpected protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(Dropped(f"malformed response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        r = self.resp
        if r is None or r.complete:
            return
        if r.head_done and r.close_delimited:
            r._end()
        else:
            self._fail(Dropped("connection closed before the answer was complete"))

    def pause_writing(self) -> None:  # requests are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.resp
        if r is None:
            return
        r.status = self.parser.get_status_code()
        r.keep_alive = self.parser.should_keep_alive()
        h = r.headers
        r.close_delimited = "content-length" not in h and "transfer-encoding" not in h
        r.head_done = True
        r._wake(None)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        if self.resp is not None:
            self.resp._end()

    # -- ours ---------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.resp is not None:
            self.resp._error(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """Status, headers (lowercase names) and the body as it arrives."""

    __slots__ = (
        "_buf",
        "_buffered",
        "_conn",
        "_err",
        "_timer",
        "_waiter",
        "close_delimited",
        "complete",
        "head_done",
        "headers",
        "keep_alive",
        "status",
    )  # fmt: skip

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = self.complete = self.keep_alive = self.close_delimited = False
        self._buf: deque[bytes] = deque()
        self._buffered = 0
        self._err: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def _wake(self, exc: BaseException | None) -> None:
        w = self._waiter
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    def _feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        self._wake(None)

    def _end(self) -> None:
        self.complete = True
        self._wake(None)

    def _error(self, exc: BaseException) -> None:
        if self._err is None:
            self._err = exc
        self._wake(exc)

    async def _wait(self) -> None:
        if self._err is not None:
            raise self._err
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self) -> None:
        while not self.head_done:
            await self._wait()

    def ready(self) -> bool:
        """``readany`` would return (or raise) without waiting for the upstream."""
        return bool(self._buf) or self.complete or self._err is not None

    async def readany(self) -> bytes:
        """The next piece of body; ``b""`` at its end."""
        while not self._buf:
            if self.complete:
                return b""
            await self._wait()
        data = self._buf.popleft()
        self._buffered -= len(data)
        if self._buffered <= _HIGH_WATER and self._conn.transport is not None:
            self._conn.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        while not self.complete:
            await self._wait()
        data = b"".join(self._buf)
        self._buf.clear()
        self._buffered = 0
        return data

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if reusable."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self._conn
        conn.resp = None
        if self.complete and self.keep_alive and not conn.closed and self._err is None:
            conn.pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Abandon the answer (and its connection)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._conn.resp = None
        self._conn.close()


class UpstreamPool:
    """Keep-alive connections per (host, port)."""

    def __init__(
        self, *, connect_timeout_s: float, request_timeout_s: float, keepalive_s: float = 2.0
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._hosts: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _put(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)

    def _pooled(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if idle:
            cutoff = time.monotonic() - self.keepalive_s
            while idle:
                conn = idle.pop()  # the most recently used: least likely to be closing
                if not conn.closed and conn.idle_since > cutoff:
                    return conn
                conn.close()
        return None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Conn(self, key), key[0], key[1])
        except ConnectionRefusedError as exc:
            raise ConnectRefused(f"connection refused by {key[0]}:{key[1]}") from exc
        except OSError as exc:
            raise ConnectRefused(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return conn

    def _target(self, base: str) -> tuple[tuple[str, int], bytes]:
        t = self._hosts.get(base)
        if t is None:
            u = urlsplit(base)
            if u.scheme != "http" or not u.hostname:
                raise UpstreamError(f"only http:// upstreams are supported, got {base!r}")
            port = u.port or 80
            host = u.hostname if ":" not in u.hostname else f"[{u.hostname}]"
            t = self._hosts[base] = ((u.hostname, port), f"{host}:{port}".encode())
        return t

    async def post(
        self,
        base: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        on_sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send ``POST base+path``; returns once the response head is in. ``on_sent``
        runs as soon as the request is written (the engine starts on it while the
        router finishes its bookkeeping), or before connecting when no pooled connection
        is free: either way before the first await that suspends."""
        return await self._send(b"POST ", base, path, body, headers, on_sent)

    async def get(self, base: str, path: str) -> UpstreamResponse:
        """Send ``GET base+path`` (health probes); returns once the response head is in."""
        return await self._send(b"GET ", base, path, b"", [], None)

    async def _send(
        self,
        method: bytes,
        base: str,
        path: str,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        on_sent: Callable[[], None] | None,
    ) -> UpstreamResponse:
        key, host = self._target(base)
        conn = self._pooled(key)
        if conn is None:
            if on_sent is not None:
                on_sent()
                on_sent = None
            conn = await self._connect(key)
        resp = conn.resp = UpstreamResponse(conn)
        conn.parser = httptools.HttpResponseParser(conn)
        parts = [method, path.encode(), b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        assert conn.transport is not None
        conn.transport.write(b"".join(parts))
        if on_sent is not None:
            on_sent()
        loop = asyncio.get_running_loop()
        resp._timer = loop.call_later(
            self.request_timeout_s, resp._error, TimeoutError("upstream request timed out")
        )
        try:
            await resp.head()
        except BaseException:
            resp.close()
            raise
        return resp

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()
