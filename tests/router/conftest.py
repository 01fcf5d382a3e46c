"""Router test fixtures: a private redis-server, both index backends, event builders.

``backend`` is memory or redis here; ``test_index_behaviour.py`` adds ``cluster`` (a
private Redis Cluster of 3 masters + 3 replicas, started once per session when first
asked for, see ``stack/redis_cluster.py``).

The Redis server is started once per session on a free port (and a unix socket) with
persistence off, and killed at the end; the system Redis is never touched. Every test
gets its own key namespace. Event builders and waits live in ``tests/routerkit.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from routerkit import new_namespace

from router.index.base import BlockIndex
from router.index.memory import MemoryIndex
from router.index.redis_cluster import RedisClusterIndex
from router.index.redis_index import RedisIndex
from stack.procs import RedisServer, private_redis
from stack.redis_cluster import RedisCluster, private_redis_cluster


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with private_redis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    with private_redis_cluster() as cluster:
        yield cluster


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
    cluster: RedisCluster | None = (
        request.getfixturevalue("redis_cluster") if backend == "cluster" else None
    )

    def make(**kw: object) -> BlockIndex:
        idx: BlockIndex
        if cluster is not None:
            idx = RedisClusterIndex(cluster.url, namespace=namespace, **kw)  # type: ignore[arg-type]
            handles.append(idx)
            return idx
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
