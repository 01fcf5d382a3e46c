"""A client that leaves mid-stream stops the relay: the engine's connection is closed (so
it can abort the generation) and the instance's running count drops; a short stream
already in hand is relayed whole."""

from __future__ import annotations

import asyncio
import json

import uvicorn

from router.app import create_app
from router.config import RouterSettings
from router.state import RouterState
from stack.procs import free_port

_CHUNK = b'data: {"choices":[{"text":"o"}]}\n\n'


class StallingUpstream:
    """Streams one SSE chunk, then nothing until its connection closes (``closed``)."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"POST "):  # the health probe
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(_CHUNK), _CHUNK)
                )
                await writer.drain()
                await reader.read()  # until the router hangs up
                self.closed.set()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> StallingUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


async def test_a_client_leaving_mid_stream_closes_the_engine_connection() -> None:
    async with StallingUpstream() as up:
        state = RouterState(RouterSettings(instances=[up.url], engine_metrics=False))
        await state.start()
        port = free_port()
        config = uvicorn.Config(
            create_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = json.dumps({"prompt": "a prompt of more than one block", "stream": True})
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body.encode())
            )
            got = b""
            while _CHUNK not in got:  # the first chunk reached the client
                got += await asyncio.wait_for(reader.read(4096), 10)
            inst = state.registry.get(up.url)
            assert inst is not None and inst.running_requests == 1
            writer.close()  # the client leaves
            await asyncio.wait_for(up.closed.wait(), 10)
            while inst.running_requests:  # the relay ended
                await asyncio.sleep(0.01)
        finally:
            server.should_exit = True
            await serving
            await state.stop()
