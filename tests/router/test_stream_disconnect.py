"""A client that leaves mid-stream stops the relay: the engine's connection is closed (so
it can abort the generation) and the instance's running count drops; a short stream
already in hand is relayed whole."""

from __future__ import annotations

import asyncio
import json

import uvicorn
from routerkit import ScriptedUpstream, eventually

from router.config import RouterSettings
from router.http.app import create_app
from router.state import RouterState
from stack.procs import free_port

_CHUNK = b'data: {"choices":[{"text":"o"}]}\n\n'


def _true(check):  # type: ignore[no-untyped-def]
    """``eventually`` awaits its check: a plain condition, wrapped."""

    async def run() -> bool:
        return bool(check())

    return run


class StallingUpstream(ScriptedUpstream):
    """Streams one SSE chunk, then nothing until its connection closes (``closed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()

    async def answer(self, head: bytes, body: bytes, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(_CHUNK), _CHUNK)
        )
        await writer.drain()
        await reader.read()  # until the router hangs up
        self.closed.set()
        return False


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
            await eventually(_true(lambda: server.started))
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
            await eventually(_true(lambda: inst.running_requests == 0))  # the relay ended
        finally:
            server.should_exit = True
            await serving
            await state.stop()
