"""Redis block index: one shared index for several router processes.

Data model (see ``redis_index.lua`` for the key list): per block a bitmap STRING over
*columns* (one column = one (instance, slot) pair, ids allocated server-side and reused),
per column a reverse HASH hash -> refcount. Writes are one Lua call per event batch
(atomic; a backlog of batches goes as one pipeline of them, one round trip); lookups one
Lua call returning every block's bitmap, which numpy transposes into per-column masks.
Clearing an instance retires its columns in O(1) -- readers stop seeing them at once --
and the bits are reclaimed in bounded chunks, O(its blocks) in total, without ever
blocking Redis for long.

Several routers may share a namespace: one (or more) ingests, all read. Each batch carries
its ``(ts, seq)``; the script applies it only if newer than the instance's stored cursor,
so two ingesters of one source never double count, and a restart reset is applied
atomically with the new incarnation's first batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index.base import (
    ApplyResult,
    Residency,
    SeqBatch,
    columns_from_rows,
    slot_of,
    tier_of,
    to_wire,
)

__all__ = ["RedisIndex", "namespace_for"]

log = logging.getLogger(__name__)

_SCRIPTS_FILE = Path(__file__).with_name("redis_index.lua")
_RECLAIM_CHUNK = 5000


def _load_scripts() -> dict[str, str]:
    text = _SCRIPTS_FILE.read_text()
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines(keepends=True):
        if line.startswith("-- @script "):
            name = line.split()[2]
            out[name] = ""
        elif name is not None:
            out[name] += line
    common = out.pop("common", "")
    return {name: common + body for name, body in out.items()}


_LUA = _load_scripts()


def namespace_for(model: str, hash_algo: str, hash_seed: str | None) -> str:
    """Key prefix for one (model, hash algorithm, NONE_HASH seed): hashes made with
    different settings never meet. The braces are a cluster hash tag."""
    seed = hash_seed if hash_seed is not None else os.getenv("PYTHONHASHSEED", "")
    digest = hashlib.sha256(f"{model}\0{hash_algo}\0{seed}".encode()).hexdigest()[:12]
    return f"kvr:{{{digest}}}"


def _pack(hashes: Sequence[Any]) -> bytes:
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except (struct.error, TypeError):
        return b"".join(to_wire(h).to_bytes(8, "big") for h in hashes)


class RedisOptions(TypedDict, total=False):
    """What every Redis-backed index takes besides its URL (``RedisIndex``,
    ``RedisClusterIndex``, ``router.index.open_index``); the defaults are ``RedisIndex``'s."""

    model: str
    hash_algo: str
    hash_seed: str | None
    namespace: str | None
    instance_ttl_s: float | None
    block_ttl_s: float | None


class RedisIndex:
    """``BlockIndex`` on Redis (``redis://``, ``rediss://``, ``unix://`` URLs).

    ``instance_ttl_s``: an instance whose ingester has not applied a batch or called
    ``touch`` for that long is invisible to lookups and dropped by ``reap``; None disables
    heartbeats. ``block_ttl_s``: optional expiry of block bitmaps, refreshed on each store
    (off by default: blocks leave when the engine evicts them, see router/README.md).
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        model: str = "",
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        namespace: str | None = None,
        instance_ttl_s: float | None = 120.0,
        block_ttl_s: float | None = None,
        client: aioredis.Redis | None = None,
    ) -> None:
        self.url = url
        self.prefix = namespace or namespace_for(model, hash_algo, hash_seed)
        self._hb_ms = int(instance_ttl_s * 1000) if instance_ttl_s else 0
        self._block_ms = int(block_ttl_s * 1000) if block_ttl_s else 0
        self._owns_client = client is None
        self.redis = client or aioredis.from_url(url, decode_responses=False)
        self._scripts = {name: self.redis.register_script(src) for name, src in _LUA.items()}
        self._colver = b""
        self._colmap: dict[int, tuple[str, int]] = {}
        self._reclaimer: asyncio.Task[None] | None = None
        self._desc: dict[Any, str] = {
            "model": model,
            "hash_algo": hash_algo,
            "hash_seed": hash_seed or "",
        }
        self._desc_written = False

    # ---- writes ------------------------------------------------------------------------

    async def apply(
        self, instance: str, batch: KVEventBatch, *, seq: int | None = None, reset: bool = False
    ) -> ApplyResult:
        await self._describe()
        r = await self._scripts["apply"](args=self._apply_args(instance, batch, seq, reset))
        res = _result(r)
        self._after_apply([res])
        return res

    async def apply_many(
        self, instance: str, items: Sequence[SeqBatch], *, reset: bool = False
    ) -> list[ApplyResult]:
        """One pipeline of apply calls: one round trip for a backlog. Not a transaction --
        each call is atomic and readers may see the batches land one by one, as with
        ``apply``; the cursor keeps a retried or concurrently ingested batch from counting
        twice. Each call is sent as soon as it is encoded and the replies are read at the
        end, so Redis runs the first batches while the next are encoded. The script is
        loaded at the head of the pipeline: no call in it can meet NOSCRIPT (a Redis
        restarted empty forgets its scripts) and run out of order."""
        if len(items) <= 1:
            return [await self.apply(instance, b, seq=s, reset=reset) for b, s in items]
        await self._describe()
        script = self._scripts["apply"]
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        replies: list[Any] = []
        try:
            await conn.send_packed_command(conn.pack_command("SCRIPT", "LOAD", script.script))
            for i, (batch, seq) in enumerate(items):
                args = self._apply_args(instance, batch, seq, reset and i == 0)
                cmd = conn.pack_command("EVALSHA", script.sha, 0, *args)
                await conn.send_packed_command(cmd, check_health=False)
            for _ in range(len(items) + 1):
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # a whole reply: the stream stays in step
                    replies.append(exc)
        except BaseException:
            await conn.disconnect()  # replies may still be on the way: never reuse it
            raise
        finally:
            await pool.release(conn)
        for r in replies:
            if isinstance(r, Exception):
                raise r
        out = [_result(r) for r in replies[1:]]
        self._after_apply(out)
        return out

    def _after_apply(self, results: list[ApplyResult]) -> None:
        if any(r.cleared for r in results):
            self._kick_reclaim()
        if any(r.cursor_absent for r in results):
            self._desc_written = False  # Redis may have restarted empty: describe it again

    def _apply_args(
        self, instance: str, batch: KVEventBatch, seq: int | None, reset: bool
    ) -> list[Any]:
        args: list[Any] = [
            self.prefix,
            instance,
            -1 if seq is None else seq,
            repr(float(batch.ts)),
            1 if reset else 0,
            self._hb_ms,
            self._block_ms,
        ]
        for ev in batch.events:
            if type(ev) is BlockStored:
                if ev.block_hashes:
                    slot = slot_of(ev.group_idx, tier_of(ev.medium))
                    args += ("S", slot, _pack(ev.block_hashes))
            elif type(ev) is BlockRemoved:
                if ev.block_hashes:
                    slot = slot_of(ev.group_idx, tier_of(ev.medium))
                    args += ("R", slot, _pack(ev.block_hashes))
            elif type(ev) is AllBlocksCleared:
                args += ("C", 0, b"")
        return args

    async def _describe(self) -> None:
        """Write the namespace's description (model, hash settings) once per client."""
        if not self._desc_written:
            await self.redis.hset(f"{self.prefix}:meta", mapping=self._desc)
            self._desc_written = True

    async def clear(self, instance: str) -> None:
        await self._scripts["drop"](args=[self.prefix, instance])
        await self._reclaim_all()

    async def reap(self) -> list[str]:
        """Drop instances whose heartbeat expired (any router may run this)."""
        gone = [g.decode() for g in await self._scripts["reap"](args=[self.prefix])]
        if gone:
            log.warning("dropped instances with expired heartbeat: %s", gone)
            self._kick_reclaim()
        return gone

    async def touch(self, instance: str) -> None:
        if self._hb_ms:
            await self.redis.set(f"{self.prefix}:hb:{instance}", b"1", px=self._hb_ms)

    async def reclaim(self, max_entries: int = _RECLAIM_CHUNK) -> int:
        """One bounded reclamation step; returns the retired columns still pending."""
        r = await self._scripts["reclaim"](args=[self.prefix, max_entries])
        return int(r[1])

    async def _reclaim_all(self) -> None:
        while await self.reclaim():
            await asyncio.sleep(0)

    def _kick_reclaim(self) -> None:
        if self._reclaimer is None or self._reclaimer.done():
            self._reclaimer = asyncio.get_running_loop().create_task(self._reclaim_bg())

    async def _reclaim_bg(self) -> None:
        try:
            await self._reclaim_all()
        except Exception:  # the next clear/reset retries; never kill the caller's loop
            log.exception("reclaiming retired columns failed")

    # ---- reads -------------------------------------------------------------------------

    async def lookup(
        self, block_hashes: Sequence[int], instances: Sequence[str] | None = None
    ) -> dict[str, Residency]:
        if not block_hashes:
            return {}
        ver, colmap, live, width, buf = await self._scripts["lookup"](
            args=[self.prefix, self._colver, 1 if self._hb_ms else 0, _pack(block_hashes)]
        )
        if ver != self._colver:
            self._colmap = _parse_colmap(colmap)
            self._colver = ver
        width = int(width)
        if not width:
            return {}
        alive = {x.decode() for x in live}
        if instances is not None:
            alive &= set(instances)
        cols = [c for c, (name, _) in self._colmap.items() if name in alive and c < width * 8]
        if not cols:
            return {}
        out: dict[str, Residency] = {}
        for col, mask in columns_from_rows(buf, len(block_hashes), width, cols, "big").items():
            name, slot = self._colmap[col]
            out.setdefault(name, {})[slot] = mask
        return out

    async def instances(self) -> list[str]:
        names = [_text(m) for m in await self.redis.smembers(f"{self.prefix}:insts")]
        if not self._hb_ms or not names:
            return sorted(names)
        pipe = self.redis.pipeline(transaction=False)
        for n in names:
            pipe.exists(f"{self.prefix}:hb:{n}")
        flags = await pipe.execute()
        return sorted(n for n, ok in zip(names, flags, strict=True) if ok)

    async def cursor(self, instance: str) -> tuple[float, int] | None:
        ts, seq = await self.redis.hmget(f"{self.prefix}:i:{instance}", ["ts", "seq"])
        if ts is None or seq is None:
            return None
        return float(ts), int(seq)

    async def put_layout(self, instance: str, layout: dict[str, Any] | None) -> None:
        await put_layout(self.redis, self.prefix, instance, layout)

    async def get_layouts(self) -> dict[str, dict[str, Any]]:
        return await get_layouts(self.redis, self.prefix)

    async def close(self) -> None:
        if self._reclaimer is not None and not self._reclaimer.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reclaimer, timeout=5)
        if self._owns_client:
            await self.redis.aclose()

    # ---- introspection (tests, benchmarks, /dashboard) ---------------------------------

    async def column_counts(self) -> dict[str, dict[int, int]]:
        """``{instance: {slot: distinct blocks held}}`` of the live columns: the column map
        and one HLEN per column, two round trips (O(columns), never O(blocks))."""
        raw = await self.redis.hgetall(f"{self.prefix}:col")
        colmap = _parse_colmap([x for kv in raw.items() for x in kv])
        cols = sorted(colmap)
        if not cols:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for col in cols:
            pipe.hlen(f"{self.prefix}:r:{col}")
        sizes = await pipe.execute()
        out: dict[str, dict[int, int]] = {}
        for col, n in zip(cols, sizes, strict=True):
            name, slot = colmap[col]
            out.setdefault(name, {})[slot] = int(n)
        return out

    async def stats(self) -> dict[str, int]:
        """Key and entry counts of this namespace (scans the namespace: not for hot paths)."""
        blocks = 0
        async for _ in self.redis.scan_iter(match=f"{self.prefix}:b:*", count=10_000):
            blocks += 1
        entries = 0
        async for key in self.redis.scan_iter(match=f"{self.prefix}:r:*", count=10_000):
            entries += await self.redis.hlen(key)
        dead = await self.redis.llen(f"{self.prefix}:dead")
        return {"blocks": blocks, "entries": entries, "dead_columns": dead}


async def put_layout(
    client: Any, prefix: str, instance: str, layout: dict[str, Any] | None
) -> None:
    """Share (None: forget) an instance's layout under ``prefix`` (``client``: a Redis or
    a RedisCluster client: one key, one slot)."""
    key = f"{prefix}:layouts"
    if layout is None:
        await client.hdel(key, instance)
    else:
        await client.hset(key, instance, json.dumps(layout))


async def get_layouts(client: Any, prefix: str) -> dict[str, dict[str, Any]]:
    raw = await client.hgetall(f"{prefix}:layouts")
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _result(r: list[Any]) -> ApplyResult:
    return ApplyResult(bool(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), bool(r[5]))


def _text(raw: bytes | str) -> str:
    """A Redis reply as text (the client is built with ``decode_responses=False``)."""
    return raw.decode() if isinstance(raw, bytes) else raw


def _parse_colmap(flat: Sequence[bytes | str]) -> dict[int, tuple[str, int]]:
    out = {}
    for i in range(0, len(flat), 2):
        slot, _, name = _text(flat[i + 1]).partition(":")
        out[int(flat[i])] = (name, int(slot))
    return out
