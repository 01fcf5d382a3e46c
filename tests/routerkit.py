"""Router test helpers: event builders, bit positions, condition waits, ingest catch-up.

A plain module on the test path (pyproject: ``pythonpath = ["tests"]``); fixtures that use
it are in ``tests/router/conftest.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Iterable
from typing import Self

import pytest
import zmq

from events.publisher import ZmqEventPublisher
from events.structs import BlockRemoved, BlockStored, KVEventBatch
from router.fleet.instances import Instance
from router.fleet.specs import InstanceSpec
from router.index import Tier, slot_of
from router.ingest import InstanceSource
from stack.procs import free_port

__all__ = [
    "C0",
    "C1",
    "G0",
    "G1",
    "LoopbackHttp",
    "PlayedSource",
    "ScriptedUpstream",
    "batch",
    "catch_up",
    "eventually",
    "free_port",
    "new_namespace",
    "positions",
    "rebind",
    "removed",
    "stored",
]

# The (group, tier) slots the index and scoring tests name: groups 0 and 1 on GPU and CPU.
G0, G1 = slot_of(0, Tier.GPU), slot_of(1, Tier.GPU)
C0, C1 = slot_of(0, Tier.CPU), slot_of(1, Tier.CPU)


def need_native(loaded: bool, what: str) -> None:
    """Skip a test of an optional native piece where it is not built, but fail where
    ``scripts/test.sh`` says it must be (``KVROUTE_REQUIRE_NATIVE=1``: a compiler and
    OpenSSL's headers were found), so a broken build is never a silent skip."""
    if loaded:
        return
    if os.environ.get("KVROUTE_REQUIRE_NATIVE") == "1" and not os.environ.get("KVROUTE_NO_NATIVE"):
        pytest.fail(f"{what} is not built: pip install -e . (needs cc + libssl-dev)")
    pytest.skip(f"{what} is not built (or KVROUTE_NO_NATIVE is set)")


def new_namespace() -> str:
    """A fresh Redis key namespace (hash-tagged, so a cluster keeps it on one slot)."""
    return f"kvr:{{t{uuid.uuid4().hex[:10]}}}"


# ---- event builders -----------------------------------------------------------------


def stored(
    hashes: list[int],
    group: int | None = 0,
    medium: str | None = "GPU",
    *,
    block_size: int = 16,
    kind: str | None = None,
    window: int | None = None,
    parent: int | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=[] if block_size == 0 else [1] * (block_size * len(hashes)),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
    )


def removed(hashes: list[int], group: int | None = 0, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


def batch(*events: object, ts: float = 1.0) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events))  # type: ignore[arg-type]


def positions(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if (mask >> i) & 1]


async def eventually(check, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``await check()`` until it returns a truthy value; return it (or fail)."""
    deadline = time.monotonic() + timeout
    while True:
        got = await check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last: {got!r})")
        await asyncio.sleep(interval)


async def catch_up(manager, name: str, publisher, seq: int, timeout: float = 10.0) -> int:
    """Wait until ``manager`` applied ``seq`` of ``name``. A batch lost to ZMQ's slow
    joiner is healed by replay once a later one arrives, so publish empty fillers while
    waiting; returns the last seq published."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await manager.wait_for_seq(name, seq, timeout=0.3)
            return seq
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            seq += 1


class PlayedSource:
    """An event source (``IngestManager``'s ``source_factory`` hook) that plays the
    subscriber items queued on ``items`` -- those given and any put later, ``None`` ending
    the stream -- and idles like a quiet publisher in between, until closed. ``source``,
    ``start_seq``: what the factory was asked to subscribe to."""

    def __init__(
        self,
        items: Iterable[object] = (),
        source: InstanceSource | None = None,
        start_seq: int | None = None,
    ) -> None:
        self.source, self.start_seq = source, start_seq
        self.items: asyncio.Queue = asyncio.Queue()
        for item in items:
            self.items.put_nowait(item)
        self.closed = False

    async def start(self) -> None:
        return None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.closed:
            raise StopAsyncIteration
        item = await self.items.get()
        if item is None:
            raise StopAsyncIteration
        return item

    async def close(self) -> None:
        self.closed = True
        self.items.put_nowait(None)


class StaticRegistry:
    """``InstanceRegistry``'s ``healthy()`` over fixed instances (no probing)."""

    def __init__(self, *urls: str) -> None:
        self.instances = [Instance(InstanceSpec(u)) for u in urls]

    def healthy(self) -> list[Instance]:
        return list(self.instances)


class LoopbackHttp:
    """A raw asyncio server on a free loopback port while ``async with``-entered; ``url`` is
    its ``http://`` base. A subclass's ``_serve`` handles each connection."""

    def __init__(self) -> None:
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


class ScriptedUpstream(LoopbackHttp):
    """A loopback HTTP/1.1 keep-alive engine stand-in, ``async with``-served: requests other
    than POST (the health probe) get ``200 {}``; a subclass's :meth:`answer` writes the
    answer to each POST. ``connections``: connections that carried a POST."""

    def __init__(self) -> None:
        super().__init__()
        self.connections = 0

    async def answer(
        self, head: bytes, body: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one POST (``head``: request line and headers); False closes the connection."""
        raise NotImplementedError

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posted = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if not head.startswith(b"POST "):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                else:
                    self.connections += not posted
                    posted = True
                    if not await self.answer(head, body, reader, writer):
                        return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def rebind(events: str, replay: str) -> ZmqEventPublisher:
    """A new publisher on the same ports once the old one's sockets have let go."""
    for _ in range(50):
        try:
            return ZmqEventPublisher(endpoint=events, bind=True, replay_endpoint=replay)
        except zmq.ZMQError:
            await asyncio.sleep(0.1)
    raise AssertionError("ports never became free")
