"""The cheapest proxy Python has, as a yardstick for the overhead benchmark (#16).

``python -m bench.replay.floor PORT UPSTREAM_URL``: an asyncio protocol with httptools'
request parser on uvloop -- no ASGI, no framework, no routing decision -- that forwards
every POST to one upstream through the router's own pooled keep-alive client
(``router.http.upstream``) and relays the answer: whole with its Content-Length, or chunk by
chunk when the upstream streams. ``GET /health`` answers 200.

It answers one question with a number: what does a Python proxy add before it decides
anything? Set beside the router (``ours:round_robin`` decides nothing either, but runs in
uvicorn behind ASGI) and beside the Rust routers in the same interleaved run, it says how
much of our added latency the ASGI server costs, and whether any Python data plane could
meet the target at all.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from http import HTTPStatus

import uvloop

from bench.replay.upstream import RequestProtocol
from router.http.upstream import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class _Relay(RequestProtocol):
    """One client connection: requests one at a time (no pipelining), relayed upstream."""

    def __init__(self, pool: UpstreamPool, upstream: str) -> None:
        super().__init__()
        self.pool, self.upstream = pool, upstream
        self.headers: list[tuple[bytes, bytes]] = []  # the one passed on: content-type

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.headers.append((b"content-type", value))

    def on_message_complete(self) -> None:
        path, body, headers = self.url.decode(), bytes(self.body), self.headers
        self.body.clear()
        self.headers = []
        if self.parser.get_method() == b"GET":
            self._write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            return
        asyncio.get_running_loop().create_task(self._forward(path, body, headers))

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def _forward(self, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            resp = await self.pool.post(self.upstream, path, body, headers)
        except (UpstreamError, TimeoutError) as exc:
            msg = str(exc).encode()
            self._write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: %d\r\n\r\n" % len(msg) + msg)
            return
        head = [f"HTTP/1.1 {resp.status} {HTTPStatus(resp.status).phrase}\r\n".encode()]
        head += [
            f"{k}: {v}\r\n".encode("latin-1") for k, v in resp.headers.items() if k not in _HOP
        ]
        try:
            if "content-length" in resp.headers:
                data = await resp.read()
                head.append(b"content-length: %d\r\n\r\n" % len(data))
                self._write(b"".join(head) + data)
            else:
                self._write(b"".join(head) + b"transfer-encoding: chunked\r\n\r\n")
                while chunk := await resp.readany():
                    self._write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                self._write(b"0\r\n\r\n")
        except (UpstreamError, TimeoutError) as exc:
            log.warning("relay from %s broke: %s", self.upstream, exc)
            if self.transport is not None:
                self.transport.close()
        finally:
            resp.release()


async def _main(port: int, upstream: str) -> None:
    pool = UpstreamPool(connect_timeout_s=5.0, request_timeout_s=60.0)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Relay(pool, upstream), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    uvloop.run(_main(int(sys.argv[1]), sys.argv[2]))
