"""Block index: which instance holds which block, per KV cache group and tier.

``open_index(url)`` picks the backend: ``None``/``memory://`` -> ``MemoryIndex`` (embedded
default), ``redis://``, ``rediss://``, ``unix://`` -> ``RedisIndex`` (shared by routers),
``redis+cluster://host:port,...`` -> ``RedisClusterIndex`` (shared, sharded by instance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Unpack

from router.index.base import (
    NUM_TIERS,
    ApplyResult,
    BlockIndex,
    Residency,
    Tier,
    group_tier,
    slot_of,
    tier_of,
    to_wire,
)
from router.index.memory import MemoryIndex

if TYPE_CHECKING:  # the Redis modules load only when a Redis URL is opened
    from router.index.redis_index import RedisOptions

__all__ = [
    "NUM_TIERS",
    "ApplyResult",
    "BlockIndex",
    "MemoryIndex",
    "Residency",
    "Tier",
    "group_tier",
    "open_index",
    "slot_of",
    "tier_of",
    "to_wire",
]


def open_index(url: str | None = None, **redis_options: Unpack[RedisOptions]) -> BlockIndex:
    """The index for ``url``; ``redis_options`` go to the Redis-backed indexes."""
    if url is None or url in ("memory", "memory://"):
        return MemoryIndex()
    if url.startswith(("redis://", "rediss://", "unix://")):
        from router.index.redis_index import RedisIndex

        return RedisIndex(url, **redis_options)
    if url.startswith("redis+cluster://"):
        from router.index.redis_cluster import RedisClusterIndex

        return RedisClusterIndex(url, **redis_options)
    raise ValueError(
        f"unsupported index URL {url!r}: use memory://, redis://, rediss://, unix://, "
        "redis+cluster://"
    )
