"""Router test fixtures: a private redis-server, both index backends, event builders.

The Redis server is started once per session on a free port (and a unix socket) with
persistence off, and killed at the end; the system Redis is never touched. Every test
gets its own key namespace. Helpers are importable as ``router_testkit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from bench.chaos.procs import free_port
from events.structs import BlockRemoved, BlockStored, KVEventBatch
from router.index.base import BlockIndex
from router.index.memory import MemoryIndex
from router.index.redis_index import RedisIndex

sys.modules.setdefault("router_testkit", sys.modules[__name__])

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


@dataclass(frozen=True)
class RedisServer:
    url: str
    unix_url: str
    port: int


@contextlib.contextmanager
def private_redis() -> Iterator[RedisServer]:
    """A throw-away redis-server on a free port and a unix socket; killed on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-redis-"))
    sock = tmp / "redis.sock"
    port = free_port()
    cmd = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "no", "--unixsocket", str(sock), "--dir", str(tmp)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("private redis-server did not start") from None
                time.sleep(0.02)
        yield RedisServer(f"redis://127.0.0.1:{port}/0", f"unix://{sock}", port)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with private_redis() as server:
        yield server


def new_namespace() -> str:
    return f"kvr:{{t{uuid.uuid4().hex[:10]}}}"


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
async def make_index(backend: str, request: pytest.FixtureRequest) -> AsyncIterator:
    """``make_index()`` -> an index handle; for Redis every handle is a separate client on
    the same namespace (another router process), for memory the same object."""
    handles: list[BlockIndex] = []
    namespace = new_namespace()
    shared = MemoryIndex()
    server: RedisServer | None = (
        request.getfixturevalue("redis_server") if backend == "redis" else None
    )

    def make(**kw: object) -> BlockIndex:
        if server is None:
            return shared
        idx = RedisIndex(server.url, namespace=namespace, **kw)  # type: ignore[arg-type]
        handles.append(idx)
        return idx

    yield make
    for h in handles:
        await h.close()


@pytest.fixture
async def index(make_index) -> BlockIndex:
    return make_index()


# ---- event builders -----------------------------------------------------------------


def stored(
    hashes: list[int],
    group: int | None = 0,
    medium: str | None = "GPU",
    *,
    block_size: int = 16,
    kind: str | None = None,
    window: int | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
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
