"""Block index sharded over a Redis Cluster (``redis+cluster://host:port,host:port,...``).

Key layout: **by instance**. The namespace is split into ``shards`` sub-namespaces, each
its own hash tag (so its own cluster slot) and each exactly ``RedisIndex``'s data model
(block bitmaps over that shard's columns, reverse indexes, cursors, heartbeats). An
instance lives in one shard, ``crc32(instance) % shards``. Why by instance and not by
block-hash range:

* an event batch touches one instance, so it stays **one atomic Lua call on one node**
  (the cursor check, a restart reset and every store/remove of the batch together), as
  on a single Redis; a block-range layout would split every batch over all shards and
  lose that atomicity (and the cursor that makes replays and two ingesters safe);
* a lookup reads every shard once, all shards at the same time (one script call per
  shard, concurrently on each node's connections), and every node MGETs the prompt's
  blocks over its own instances only: the work of one lookup is spread over the masters
  rather than repeated;
* clearing an instance, reaping heartbeats and reclaiming columns stay shard-local.

The shard tags are chosen so that shard ``k`` hashes into the ``k``-th equal range of
the 16384 slots: ``redis-cli --cluster create`` gives each master an equal contiguous
range, so with ``shards`` a multiple of the master count the shards spread evenly. The
shard count is fixed per namespace on first use (stored at ``<namespace>:cluster``), so
every router sharing the namespace maps instances the same way; it defaults to the
number of masters at that moment (``?shards=N`` in the URL overrides it).

Failover: writes go to the master of the shard's slot. Redis replicates asynchronously,
so a master that dies may take acknowledged batches with it. Whenever a shard's master
changes (or a write to it failed), the next write of each instance on that shard reports
``ApplyResult.cursor_absent`` on its first batch, which makes ingest clear the instance
and rebuild it from the publisher's replay buffer -- the same path as a Redis that
restarted empty. Lookups answer from the shards that answer; a shard without a master
(for the seconds a failover takes) is left out, counted in ``partial_lookups``, and the
slot map refreshed. That needs the cluster's nodes to keep serving the other slots while
one fails over: ``cluster-require-full-coverage no`` (Redis' default, ``yes``, stops the
whole cluster, and with it every lookup, until the replica has taken over).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Unpack
from urllib.parse import parse_qs, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from events.structs import KVEventBatch
from router.index.base import ApplyResult, Residency, SeqBatch
from router.index.redis_index import RedisIndex, get_layouts, namespace_for, put_layout

if TYPE_CHECKING:
    from router.index.redis_index import RedisOptions

__all__ = ["ClusterPubSub", "RedisClusterIndex", "parse_cluster_url", "shard_prefixes"]

log = logging.getLogger(__name__)

SCHEME = "redis+cluster://"
_CONNECT_TIMEOUT_S = 1.0


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """``redis+cluster://h1:p1,h2:p2/?shards=6`` -> ([(h1, p1), (h2, p2)], {"shards": "6"}).
    Raises ValueError naming what is wrong."""
    if not url.startswith(SCHEME):
        raise ValueError(f"not a cluster URL (want {SCHEME}host:port,...): {url!r}")
    parts = urlsplit("redis://" + url[len(SCHEME) :])
    nodes = []
    for item in parts.netloc.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"cluster node {item!r} in {url!r} is not host:port")
        nodes.append((host, int(port)))
    opts = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(opts) - {"shards"}
    if unknown:
        raise ValueError(f"unknown cluster URL option(s) {sorted(unknown)} in {url!r}")
    if "shards" in opts and (not opts["shards"].isdigit() or not 1 <= int(opts["shards"]) <= 1024):
        raise ValueError(f"shards must be 1..1024 in {url!r}")
    return nodes, opts


def shard_prefixes(namespace: str, shards: int) -> list[str]:
    """The key prefix of each shard: the namespace with its hash tag replaced by one that
    falls into the shard's equal share of the slot range (deterministic: every router
    derives the same prefixes)."""
    open_, close = namespace.find("{"), namespace.find("}")
    if 0 <= open_ < close:
        head, tag, tail = namespace[:open_], namespace[open_ + 1 : close], namespace[close + 1 :]
    else:
        head, tag, tail = namespace + ":", "", ""
    out = []
    width = REDIS_CLUSTER_HASH_SLOTS / shards
    for k in range(shards):
        lo, hi = int(k * width), int((k + 1) * width)
        for j in range(1_000_000):
            cand = f"{tag}.{k}.{j}"
            if lo <= key_slot(cand.encode()) < hi:
                out.append(f"{head}{{{cand}}}{tail}")
                break
        else:  # pragma: no cover - crc16 covers every range long before this
            raise RuntimeError(f"no hash tag for shard {k}")
    return out


def shard_of(instance: str, shards: int) -> int:
    return zlib.crc32(instance.encode()) % shards


class RedisClusterIndex:
    """``BlockIndex`` over a Redis Cluster; see the module docstring for the layout.

    Options are ``RedisIndex``'s (``RedisOptions``, with its defaults; each shard is a
    ``RedisIndex`` built with them) plus ``shards`` (None: the URL's ``shards``, else the
    namespace's stored count, else the number of masters)."""

    def __init__(
        self, url: str, *, shards: int | None = None, **options: Unpack[RedisOptions]
    ) -> None:
        nodes, opts = parse_cluster_url(url)
        self.url = url
        self.prefix = options.pop("namespace", None) or namespace_for(
            options.get("model", ""), options.get("hash_algo", "sha256"), options.get("hash_seed")
        )
        self._want_shards = shards or (int(opts["shards"]) if "shards" in opts else None)
        self._opts = options  # for each shard's RedisIndex (the namespace is the shard's)
        # Startup nodes built with redis.cluster's ClusterNode (host and port only), as this
        # index is tested; redis-py types the parameter with its asyncio ClusterNode.
        startup: Any = [ClusterNode(h, p) for h, p in nodes]
        self.cluster = RedisCluster(startup_nodes=startup, decode_responses=False)
        self._prefixes: list[str] = []
        self._ready_lock = asyncio.Lock()
        self._nodes: dict[str, aioredis.Redis] = {}  # "host:port" -> client of that node
        self._shards: dict[tuple[int, str], RedisIndex] = {}  # (shard, node) -> its index
        self._master: dict[int, str] = {}  # shard -> the node its writes last went to
        self._epoch: dict[int, int] = {}  # shard -> bumped when its master may have changed
        self._written: dict[str, int] = {}  # instance -> its shard's epoch at its last write
        self._stale_map = False
        self.partial_lookups = 0
        self.failovers_seen = 0
        self._pubsub: ClusterPubSub | None = None

    # ---- shards ------------------------------------------------------------------------

    async def _ready(self) -> None:
        if self._prefixes:
            return
        async with self._ready_lock:
            if self._prefixes:
                return
            await self.cluster.initialize()
            key = f"{self.prefix}:cluster"
            want = self._want_shards or len(self.cluster.get_primaries())
            await self.cluster.set(key, str(want), nx=True)
            n = int(await self.cluster.get(key) or want)
            if self._want_shards and n != self._want_shards:
                log.warning(
                    "namespace %s is sharded %d ways (asked for %d): using %d",
                    self.prefix, n, self._want_shards, n,
                )  # fmt: skip
            self._prefixes = shard_prefixes(self.prefix, n)

    @property
    def shards(self) -> int:
        return len(self._prefixes)

    async def _refresh(self) -> None:
        """Re-read the slot map (after a failed call: a failover may be under way)."""
        self._stale_map = False
        with contextlib.suppress(Exception):
            await self.cluster.nodes_manager.initialize()

    def _node_client(self, node: AsyncClusterNode) -> aioredis.Redis:
        name = f"{node.host}:{node.port}"
        c = self._nodes.get(name)
        if c is None:
            # Fail fast: ingest retries with its own backoff, and a lookup must not wait
            # on a dead master (it answers from the other shards instead).
            c = self._nodes[name] = aioredis.Redis(
                host=node.host,
                port=int(node.port),
                decode_responses=False,
                socket_connect_timeout=_CONNECT_TIMEOUT_S,
                retry=Retry(NoBackoff(), 0),
            )
        return c

    def _shard(self, k: int) -> RedisIndex:
        """Shard ``k``'s index on the node now serving its slot as master; a change of
        master bumps the shard's epoch (writes may have been lost)."""
        prefix = self._prefixes[k]
        node = self.cluster.get_node_from_key(prefix + ":meta", replica=False)
        if node is None:
            raise RuntimeError(f"no master serves index shard {k} ({prefix})")
        name = f"{node.host}:{node.port}"
        last = self._master.get(k)
        if last is not None and last != name:
            log.warning("index shard %d moved %s -> %s (failover?)", k, last, name)
            self._epoch[k] = self._epoch.get(k, 0) + 1
            self.failovers_seen += 1
        self._master[k] = name
        idx = self._shards.get((k, name))
        if idx is None:
            options = self._opts.copy()
            options["namespace"] = prefix
            idx = self._shards[(k, name)] = RedisIndex(
                name, client=self._node_client(node), **options
            )
        return idx

    async def _for(self, instance: str) -> tuple[int, RedisIndex]:
        await self._ready()
        if self._stale_map:
            await self._refresh()
        k = shard_of(instance, self.shards)
        return k, self._shard(k)

    def _failed(self, k: int) -> None:
        self._epoch[k] = self._epoch.get(k, 0) + 1
        self._stale_map = True

    # ---- writes ------------------------------------------------------------------------

    async def apply(
        self, instance: str, batch: KVEventBatch, *, seq: int | None = None, reset: bool = False
    ) -> ApplyResult:
        return (await self.apply_many(instance, [(batch, seq)], reset=reset))[0]

    async def apply_many(
        self, instance: str, items: Sequence[SeqBatch], *, reset: bool = False
    ) -> list[ApplyResult]:
        """The instance's shard's ``apply_many``: each batch one atomic call on one node.
        After the shard's master changed (or a write to it failed) since this instance's
        last write, the first result says ``cursor_absent``: the new master may lack
        batches the old one acknowledged, so ingest rebuilds the instance from replay."""
        k, idx = await self._for(instance)
        try:
            out = await idx.apply_many(instance, items, reset=reset)
        except Exception:
            self._failed(k)
            raise
        epoch = self._epoch.get(k, 0)
        before = self._written.get(instance)
        self._written[instance] = epoch
        if out and before is not None and before != epoch and not reset:
            out[0].cursor_absent = True
        return out

    async def clear(self, instance: str) -> None:
        k, idx = await self._for(instance)
        try:
            await idx.clear(instance)
        except Exception:
            self._failed(k)
            raise
        self._written[instance] = self._epoch.get(k, 0)

    async def touch(self, instance: str) -> None:
        _, idx = await self._for(instance)
        await idx.touch(instance)

    async def reap(self) -> list[str]:
        await self._ready()
        gone: list[str] = []
        for k in range(self.shards):
            gone += await self._shard(k).reap()
        return gone

    # ---- reads -------------------------------------------------------------------------

    async def lookup(
        self, block_hashes: Sequence[int], instances: Sequence[str] | None = None
    ) -> dict[str, Residency]:
        """Every shard's lookup at once (only the shards holding one of ``instances``
        when given); shards that fail are left out of the answer and counted."""
        if not block_hashes:
            return {}
        await self._ready()
        if self._stale_map:
            await self._refresh()
        ks: Sequence[int] = range(self.shards)
        if instances is not None:
            ks = sorted({shard_of(name, self.shards) for name in instances})
        parts = await asyncio.gather(
            *(self._shard(k).lookup(block_hashes, instances) for k in ks), return_exceptions=True
        )
        out: dict[str, Residency] = {}
        for k, part in zip(ks, parts, strict=True):
            if isinstance(part, BaseException):
                if not isinstance(part, Exception):
                    raise part
                self.partial_lookups += 1
                self._stale_map = True
                log.warning("index shard %d did not answer a lookup: %s", k, part)
                continue
            out.update(part)
        return out

    async def instances(self) -> list[str]:
        await self._ready()
        names: list[str] = []
        for k in range(self.shards):
            names += await self._shard(k).instances()
        return sorted(names)

    async def cursor(self, instance: str) -> tuple[float, int] | None:
        _, idx = await self._for(instance)
        return await idx.cursor(instance)

    async def put_layout(self, instance: str, layout: dict[str, Any] | None) -> None:
        await put_layout(self.cluster, self.prefix, instance, layout)

    async def get_layouts(self) -> dict[str, dict[str, Any]]:
        return await get_layouts(self.cluster, self.prefix)

    def pubsub_client(self) -> ClusterPubSub:
        """What ``router.prediction.shared`` publishes and subscribes through (the cluster
        client has no pub/sub): one node at a time, the next one when it fails."""
        if self._pubsub is None:
            self._pubsub = ClusterPubSub(self)
        return self._pubsub

    async def close(self) -> None:
        if self._pubsub is not None:
            await self._pubsub.aclose()
        for idx in self._shards.values():
            with contextlib.suppress(Exception):
                await idx.close()
        for c in self._nodes.values():
            with contextlib.suppress(Exception):
                await c.aclose()
        with contextlib.suppress(Exception):
            await self.cluster.aclose()

    # ---- introspection (tests, benchmarks, /dashboard) ---------------------------------

    async def column_counts(self) -> dict[str, dict[int, int]]:
        await self._ready()
        out: dict[str, dict[int, int]] = {}
        for k in range(self.shards):
            out.update(await self._shard(k).column_counts())
        return out

    async def stats(self) -> dict[str, int]:
        await self._ready()
        total: dict[str, int] = {}
        for k in range(self.shards):
            for key, v in (await self._shard(k).stats()).items():
                total[key] = total.get(key, 0) + v
        return total

    async def reclaim(self, max_entries: int = 5000) -> int:
        await self._ready()
        return sum([await self._shard(k).reclaim(max_entries) for k in range(self.shards)])


class ClusterPubSub:
    """Pub/sub on a Redis Cluster, as ``SharedPredictions`` uses a plain client's
    (``publish`` and ``pubsub()``): redis-py's async cluster client has none, but a
    cluster's classic pub/sub is broadcast -- a PUBLISH on any node reaches subscribers on
    every node over the cluster bus -- so one plain connection to one node serves both.
    When that node fails (a call raises), the next call goes to the next node: the
    cluster's nodes as last mapped (masters and replicas), then the URL's. What was
    published while a subscriber moved is lost, as pub/sub loses it anywhere: records
    expire and loads are republished, so a replica's view is stale for that long only."""

    def __init__(self, index: RedisClusterIndex) -> None:
        self._index = index
        self._seed = parse_cluster_url(index.url)[0]
        self._tried: list[str] = []  # nodes failed since the last good call, most recent last
        self.node: str | None = None  # "host:port" now used
        self._client: aioredis.Redis | None = None
        self.moves = 0  # times it went to another node

    def _candidates(self) -> list[str]:
        known = [f"{h}:{p}" for h, p in self._seed]
        with contextlib.suppress(Exception):
            cache = self._index.cluster.nodes_manager.nodes_cache
            known = [*dict.fromkeys([*cache, *known])]
        return known

    def _current(self) -> aioredis.Redis:
        if self._client is None:
            nodes = self._candidates()
            fresh = [n for n in nodes if n not in self._tried] or nodes
            if len(fresh) == len(nodes):
                self._tried = []  # every node tried: start over
            self.node = fresh[0]
            host, port = self.node.rsplit(":", 1)
            self._client = aioredis.Redis(
                host=host, port=int(port), decode_responses=False,
                socket_connect_timeout=_CONNECT_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
            )  # fmt: skip
        return self._client

    def _failed(self, node: str | None) -> None:
        """``node`` failed a call: the next call goes elsewhere (once per failure)."""
        if node is None or node != self.node or self._client is None:
            return
        self._tried.append(node)
        client, self._client = self._client, None
        self.moves += 1
        log.warning("replica share: cluster node %s failed; moving to another", node)
        asyncio.get_running_loop().create_task(_quietly_close(client))

    async def publish(self, channel: str, payload: bytes) -> int:
        client, node = self._current(), self.node
        try:
            n: int = await client.publish(channel, payload)
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
            self._failed(node)
            raise
        self._tried = []
        return n

    def pubsub(self) -> _NodePubSub:
        return _NodePubSub(self)

    async def aclose(self) -> None:
        if self._client is not None:
            await _quietly_close(self._client)
            self._client = None


class _NodePubSub:
    """A subscription on the node ``ClusterPubSub`` uses now; ``subscribe`` again after a
    failure subscribes on the node it moved to."""

    def __init__(self, owner: ClusterPubSub) -> None:
        self._owner = owner
        self._ps: Any = None
        self._node: str | None = None

    async def subscribe(self, *channels: str) -> None:
        if self._ps is not None:
            with contextlib.suppress(Exception):
                await self._ps.aclose()
        client = self._owner._current()
        self._node = self._owner.node
        self._ps = client.pubsub()
        try:
            await self._ps.subscribe(*channels)
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
            self._owner._failed(self._node)
            raise

    async def get_message(self, **kw: Any) -> Any:
        try:
            return await self._ps.get_message(**kw)
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
            self._owner._failed(self._node)
            raise

    async def aclose(self) -> None:
        if self._ps is not None:
            with contextlib.suppress(Exception):
                await self._ps.aclose()
            self._ps = None


async def _quietly_close(client: aioredis.Redis) -> None:
    with contextlib.suppress(Exception):
        await client.aclose()
