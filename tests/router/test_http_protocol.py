"""The router's HTTP protocol sends a response's head with its body: one write, not two.

uvicorn writes the status line and headers on ``http.response.start`` and the body on
the next message, two syscalls and two segments for every answer. ``HttpProtocol`` holds
the head until the body. Checked on real uvicorn over real sockets: the bytes a client
reads are the same HTTP (non-streaming, chunked stream, empty body, a head followed by
nothing for a while, keep-alive reuse), and the transport underneath saw one write fewer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import uvicorn
from routerkit import eventually

from router.http.protocol import HttpProtocol
from stack.procs import free_port

WRITES: list[bytes] = []
RELEASE = asyncio.Event()  # /late answers its body once the client has its head


class _Spy:
    """Counts what reaches the real transport (everything else passes through)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._t = transport

    def write(self, data: bytes) -> None:
        WRITES.append(bytes(data))
        self._t.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


class SpiedProtocol(HttpProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Spy(transport))  # type: ignore[arg-type]


async def app(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/whole":
        body = b'{"ok": true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"chunk%d;" % i, "more_body": True})
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b""})
    elif path == "/late":  # the head alone first; the body once the client read it
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await RELEASE.wait()
        await send({"type": "http.response.body", "body": b"late"})
    else:
        headers = [(b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


async def test_answers_are_the_same_http_in_fewer_writes() -> None:
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=SpiedProtocol,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())

    async def started() -> bool:
        return server.started

    try:
        await eventually(started)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            WRITES.clear()
            r = await client.get("/whole")
            assert (r.status_code, r.json()) == (200, {"ok": True})
            assert len(WRITES) == 1 and WRITES[0].startswith(b"HTTP/1.1 200 OK\r\n")

            WRITES.clear()
            r = await client.get("/stream")
            assert r.text == "chunk0;chunk1;chunk2;"
            # head + first chunk, two more chunks, the terminator (uvicorn alone: 5)
            assert len(WRITES) == 4 and WRITES[0].endswith(b"chunk0;\r\n")

            WRITES.clear()
            RELEASE.clear()
            # A head held until its body would never come: the body waits for the head.
            async with asyncio.timeout(10), client.stream("GET", "/late") as r:
                assert r.status_code == 201
                RELEASE.set()
                assert await r.aread() == b"late"
            assert len(WRITES) == 2

            WRITES.clear()
            r = await client.get("/empty")
            assert r.status_code == 204 and r.content == b""
            assert len(WRITES) == 1
    finally:
        server.should_exit = True
        await serving
