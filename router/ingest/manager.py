"""``IngestManager``: one event source per instance, applied in order into a block index."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry

from events.structs import KVEventBatch
from router.index.base import BlockIndex
from router.ingest.checks import impossible, plausible_ts
from router.ingest.metrics import IngestMetrics
from router.ingest.sources import EventSource, Feed, InstanceSource, SourceFactory
from router.layout import InstanceLayout, LayoutRegistry

# The name it always had (``router.ingest``): log filters and levels keep working.
log = logging.getLogger("router.ingest")


class IngestManager:
    """Owns one event source per instance and feeds an index (and the layout registry)."""

    def __init__(
        self,
        index: BlockIndex,
        layouts: LayoutRegistry | None = None,
        *,
        registry: CollectorRegistry | None = None,
        source_factory: SourceFactory | None = None,
        replay_timeout: float = 2.0,
        heartbeat_s: float | None = 30.0,
        retry_delays: tuple[float, ...] = (0.05, 0.2, 1.0, 2.0, 5.0),
        cursor_check_s: float | None = 2.0,
    ) -> None:
        self.index = index
        self.layouts = layouts if layouts is not None else LayoutRegistry()
        self.metrics = IngestMetrics(registry)
        self._factory = source_factory or self._zmq_source
        self._replay_timeout = replay_timeout
        self._heartbeat_s = heartbeat_s
        self._retry_delays = retry_delays
        self._cursor_check_s = cursor_check_s
        self._feeds: dict[str, Feed] = {}
        self._beat: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._closed = False

    def _zmq_source(self, source: InstanceSource, start_seq: int | None) -> EventSource:
        from events.subscriber import ZmqEventSubscriber

        return ZmqEventSubscriber(
            source.endpoint,
            source.replay_endpoint,
            source.topic,
            start_seq=start_seq,
            replay_timeout=self._replay_timeout,
            name=source.name,
        )

    # ---- instances ---------------------------------------------------------------------

    async def add_instance(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        layout: InstanceLayout | None = None,
        start_seq: int | None = None,
    ) -> None:
        """Start following an instance; ``layout`` overrides what events would teach."""
        if self._closed:
            raise RuntimeError("ingest manager is closed")
        if name in self._feeds:
            raise ValueError(f"instance {name!r} is already ingested")
        if layout is not None:
            self.layouts.configure(name, layout)
        feed = Feed(InstanceSource(name, endpoint, replay_endpoint, topic), start_seq)
        self._feeds[name] = feed
        feed.task = asyncio.get_running_loop().create_task(self._run(feed), name=f"ingest-{name}")
        if self._heartbeat_s and self._beat is None:
            self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        if self._cursor_check_s and self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_cursors())

    async def remove_instance(self, name: str) -> None:
        """Stop following ``name`` and forget its blocks."""
        feed = self._feeds.pop(name, None)
        if feed is not None:
            await self._stop(feed)
        await self.index.clear(name)
        await self.index.put_layout(name, None)
        self.layouts.forget(name)
        self.layouts.configure(name, None)

    def resync(self, name: str) -> None:
        """Forget ``name``'s blocks and rebuild them from its publisher's replay buffer
        (seq 0 on; without a replay endpoint, from the live stream). Returns at once: the
        instance's loop is restarted and clears the index first."""
        feed = self._feeds.get(name)
        if feed is None or self._closed:
            return
        feed.synced = False
        feed.task = asyncio.get_running_loop().create_task(
            self._restart(feed, feed.task), name=f"ingest-{name}"
        )

    def instances(self) -> list[str]:
        return list(self._feeds)

    def last_seq(self, name: str) -> int | None:
        return self._feeds[name].last_seq

    async def wait_for_seq(self, name: str, seq: int, timeout: float = 10.0) -> None:
        """Wait until a batch with sequence ``>= seq`` of ``name`` has been applied."""
        feed = self._feeds[name]
        async with asyncio.timeout(timeout):
            while feed.last_seq is None or feed.last_seq < seq:
                feed.changed.clear()
                await feed.changed.wait()

    async def close(self) -> None:
        self._closed = True
        for task in (self._beat, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for feed in list(self._feeds.values()):
            await self._stop(feed)

    async def _stop(self, feed: Feed) -> None:
        feed.stopped = True
        task = feed.task
        # Cancel until it ends: an await inside the loop (a subscriber's close) may swallow
        # one cancellation.
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("%s: ingest task failed", feed.source.name, exc_info=task.exception())
        if feed.sub is not None:
            with contextlib.suppress(Exception):
                await feed.sub.close()

    # ---- the per-instance loop ---------------------------------------------------------

    async def _restart(self, feed: Feed, old: asyncio.Task[None] | None) -> None:
        """``resync``: stop the previous loop (its ``finally`` closes its subscriber), then
        run a new one that starts by clearing the instance."""
        while old is not None and not old.done():  # (a close inside may swallow one cancel)
            old.cancel()
            await asyncio.wait({old}, timeout=1.0)  # our own cancellation still propagates
        if feed.sub is not None:
            with contextlib.suppress(Exception):
                await feed.sub.close()
        await self._run(feed, resync=True)

    async def _run(self, feed: Feed, *, resync: bool = False) -> None:
        name = feed.source.name
        start_seq = feed.start_seq
        if resync:
            start_seq = 0 if await self._resync(feed) else None
            feed.resyncing = start_seq == 0
        failures = 0
        while not (self._closed or feed.stopped):
            sub = feed.sub = self._factory(feed.source, start_seq)
            feed.seen_stats = {}
            resync = False
            try:
                await sub.start()
                async for item in sub:
                    resync = await self._handle(feed, item)
                    self._sync_stats(feed, sub)
                    failures = 0
                    if resync:
                        break
            except asyncio.CancelledError:
                raise
            except Exception:
                failures += 1
                self.metrics.errors.labels(name).inc()
                log.exception("%s: event source failed", name)
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
            finally:
                self._sync_stats(feed, sub)
                with contextlib.suppress(Exception):
                    await sub.close()
            if resync:
                start_seq, feed.resyncing = 0, True
            elif feed.last_seq is not None and feed.source.replay_endpoint:
                start_seq = feed.last_seq + 1  # source ended or failed: resume where we were
            else:
                start_seq = None

    async def _handle(self, feed: Feed, item: Any) -> bool:
        """Handle one subscriber item; True asks for a resubscription from seq 0."""
        name = feed.source.name
        kind = type(item).__name__
        if kind == "BatchReceived":
            feed.resyncing = False
            ok = await self._apply(feed, item.seq, item.batch, replayed=item.replayed)
            if not ok:
                return await self._resync(feed)
            return False
        if kind == "SourceRestarted":
            log.warning("%s: publisher restarted (seq %d -> %d)", name, item.last_seq, item.new_seq)
            self.metrics.restarts.labels(name).inc()
            feed.pending_reset = True
            return False
        if kind == "BatchesMissed":
            self.metrics.missed.labels(name).inc(item.last_seq - item.first_seq + 1)
            if feed.resyncing:
                return False  # older than the publisher's buffer: nothing more to get
            return await self._resync(feed)
        log.warning("%s: unknown subscriber item %r ignored", name, item)
        return False

    async def _resync(self, feed: Feed) -> bool:
        name = feed.source.name
        self.metrics.resyncs.labels(name).inc()
        log.warning("%s: state unknown, clearing it", name)
        feed.synced = False
        feed.pending_reset = True  # if clear fails, the next applied batch resets instead
        with contextlib.suppress(Exception):
            await self.index.clear(name)
            feed.pending_reset = False
        if feed.source.replay_endpoint is None:
            return False
        feed.last_seq = None  # waiters wait for the rebuilt state, not the cleared one
        return True

    async def _apply(self, feed: Feed, seq: int, batch: KVEventBatch, *, replayed: bool) -> bool:
        name = feed.source.name
        m = self.metrics
        if plausible_ts(batch.ts):
            if any(map(impossible, batch.events)):
                batch = self._drop_impossible(name, batch)
            status = await self._store(feed, seq, batch)
        else:  # applied, its (ts, seq) would make every later batch look stale
            log.warning("%s: batch %d with impossible ts %r dropped", name, seq, batch.ts)
            status = "invalid"
        counts: dict[str, int] = {}
        for ev in batch.events:
            counts[type(ev).__name__] = counts.get(type(ev).__name__, 0) + 1
        for kind, n in counts.items():
            m.events.labels(name, kind, status).inc(n)
        m.batches.labels(name, "replay" if replayed else "live").inc()
        if replayed:
            m.replays.labels(name).inc()
        elif status != "invalid":
            lag = max(0.0, time.time() - batch.ts)
            m.lag.labels(name).set(lag)
            m.lag_hist.observe(lag)
        feed.last_seq = seq
        feed.handled += 1
        m.last_seq.labels(name).set(seq)
        feed.changed.set()
        return status != "error"

    async def _store(self, feed: Feed, seq: int, batch: KVEventBatch) -> str:
        """Learn the layout, apply to the index (retrying); ``applied``/``stale``/``error``."""
        name = feed.source.name
        m = self.metrics
        try:
            learned = self.layouts.learned(name) if self.layouts.observe(name, batch) else None
        except Exception:  # never let odd geometry stop the feed; the index still learns
            m.errors.labels(name).inc()
            log.exception("%s: cannot learn the layout from batch %d", name, seq)
            learned = None
        if learned is not None:
            with contextlib.suppress(Exception):
                await self.index.put_layout(name, learned.to_dict())
        for delay in (*self._retry_delays, None):
            try:
                if feed.synced and not feed.pending_reset and not await self._has_cursor(name):
                    log.warning("%s: the index lost this instance's state", name)
                    return "error"  # -> resync: rebuild from replay, not onto nothing
                res = await self.index.apply(name, batch, seq=seq, reset=feed.pending_reset)
            except Exception:
                m.errors.labels(name).inc()
                log.exception("%s: applying batch %d failed", name, seq)
                if delay is None:
                    break
                await asyncio.sleep(delay)
                continue
            feed.pending_reset = False
            feed.synced = True
            return "applied" if res.applied else "stale"
        return "error"

    async def _has_cursor(self, name: str) -> bool:
        return await self.index.cursor(name) is not None

    def _drop_impossible(self, name: str, batch: KVEventBatch) -> KVEventBatch:
        keep = [ev for ev in batch.events if not impossible(ev)]
        for ev in batch.events:
            if impossible(ev):
                self.metrics.events.labels(name, type(ev).__name__, "invalid").inc()
        log.warning(
            "%s: %d events with impossible group_idx dropped", name, len(batch.events) - len(keep)
        )
        return KVEventBatch(ts=batch.ts, events=keep, data_parallel_rank=batch.data_parallel_rank)

    def _sync_stats(self, feed: Feed, sub: EventSource) -> None:
        """Mirror the subscriber's own counters (gaps, bad payloads) into metrics."""
        stats = getattr(sub, "stats", None)
        if stats is None:
            return
        name = feed.source.name
        for attr, counter in (
            ("gaps", self.metrics.gaps),
            ("undecodable", self.metrics.undecodable),
        ):
            now = int(getattr(stats, attr, 0))
            delta = now - feed.seen_stats.get(attr, 0)
            if delta > 0:
                counter.labels(name).inc(delta)
                feed.seen_stats[attr] = now

    async def _heartbeat(self) -> None:
        """Keep shared-index heartbeats fresh; drop instances whose ingesters died."""
        assert self._heartbeat_s
        while True:
            await asyncio.sleep(self._heartbeat_s)
            for name in list(self._feeds):
                with contextlib.suppress(Exception):
                    await self.index.touch(name)
            reap = getattr(self.index, "reap", None)
            if reap is not None:
                with contextlib.suppress(Exception):
                    await reap()

    async def _watch_cursors(self) -> None:
        """Idle instances: a synced feed whose cursor vanished lost its state (a Redis that
        restarted empty, a reaped heartbeat); busy ones are checked before each apply."""
        assert self._cursor_check_s
        while True:
            await asyncio.sleep(self._cursor_check_s)
            for name, feed in list(self._feeds.items()):
                if not feed.synced:
                    continue
                try:
                    lost = not await self._has_cursor(name)
                except Exception:
                    continue  # unreachable: the next apply retries and checks again
                if lost and feed.synced and self._feeds.get(name) is feed:
                    log.warning("%s: the index lost this instance's state", name)
                    self.resync(name)
