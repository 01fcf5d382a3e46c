"""``IngestManager``: one event source per instance, applied in order into a block index."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from events.structs import KVEventBatch
from events.subscriber import BatchesMissed, BatchReceived, SourceRestarted, SubscriberItem
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.index.base import BlockIndex
from router.ingest.ahead import ReadAhead
from router.ingest.checks import any_impossible, impossible, plausible_ts
from router.ingest.listener import IngestListener
from router.ingest.metrics import FeedMetrics, IngestMetrics
from router.ingest.sources import EventSource, Feed, InstanceSource, SourceFactory
from router.ingest.trim import HeapTrimmer

# The name it always had (``router.ingest``): log filters and levels keep working.
log = logging.getLogger("router.ingest")


@dataclass(eq=False)
class IngestManager:
    """Owns one event source per instance and feeds an index (and the layout registry)."""

    index: BlockIndex
    layouts: LayoutRegistry = field(default_factory=LayoutRegistry)
    _: KW_ONLY
    registry: InitVar[CollectorRegistry | None] = None  # where IngestMetrics registers
    source_factory: SourceFactory | None = None  # default: a ZMQ subscriber per instance
    replay_timeout: float = 2.0
    heartbeat_s: float | None = 30.0
    retry_delays: tuple[float, ...] = (0.05, 0.2, 1.0, 2.0, 5.0)
    cursor_check_s: float | None = 2.0
    # A backlog is applied in chunks of at most this many batches / blocks: one index
    # round trip each, small enough that waiters and lag see progress every few ms.
    drain_batches: int = 64
    drain_blocks: int = 16_384
    # Told of each batch before it is applied and of each applied run (predict-on-route
    # hands its settled predictions over to the index there; memory pressure is read).
    listener: IngestListener | None = None
    # Replays (a cold start, a resync) in flight at once: a replay's answer -- up to the
    # publisher's whole buffer, in wire form -- is held until applied, so a cold router
    # meeting a fleet took every instance's backlog into memory at once. The others wait
    # their turn (their publishers keep buffering).
    concurrent_replays: int = 8
    metrics: IngestMetrics = field(init=False)
    # Gives the heap back to the OS once a large backlog has been applied.
    trimmer: HeapTrimmer = field(default_factory=HeapTrimmer, init=False)
    _feeds: dict[str, Feed] = field(default_factory=dict, init=False, repr=False)
    _beat: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _watch: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self, registry: CollectorRegistry | None) -> None:
        self.metrics = IngestMetrics(registry)
        self._replay_slots = asyncio.Semaphore(self.concurrent_replays)
        self._factory = self.source_factory or self._zmq_source

    def _zmq_source(self, source: InstanceSource, start_seq: int | None) -> EventSource:
        from events.subscriber import ZmqEventSubscriber

        return ZmqEventSubscriber(
            source.endpoint,
            source.replay_endpoint,
            source.topic,
            start_seq=start_seq,
            bind=source.bind,
            replay_timeout=self.replay_timeout,
            name=source.name,
            token_ids=False,  # routing never recomputes hashes from an event's tokens
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
        bind: bool | None = None,
    ) -> None:
        """Start following an instance; ``layout`` overrides what events would teach."""
        if self._closed:
            raise RuntimeError("ingest manager is closed")
        if name in self._feeds:
            raise ValueError(f"instance {name!r} is already ingested")
        if layout is not None:
            self.layouts.configure(name, layout)
        source = InstanceSource(name, endpoint, replay_endpoint, topic, bind)
        feed = Feed(source, start_seq, FeedMetrics(self.metrics, name))
        self._feeds[name] = feed
        feed.task = asyncio.get_running_loop().create_task(self._run(feed), name=f"ingest-{name}")
        if self.heartbeat_s and self._beat is None:
            self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        if self.cursor_check_s and self._watch is None:
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

    def view(self, name: str) -> dict[str, Any] | None:
        """Whether ``name``'s state is complete or partial (``router.ingest.view``)."""
        feed = self._feeds.get(name)
        return None if feed is None else feed.view.describe()

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
        else:
            start_seq = await self._starting_point(feed, start_seq)
        failures = 0
        while not (self._closed or feed.stopped):
            sub = feed.sub = self._factory(feed.source, start_seq)
            feed.seen_stats = {}
            resync = False
            ahead: ReadAhead | None = None
            slot: asyncio.Semaphore | None = None
            try:
                if start_seq is not None:  # a replay: its whole answer arrives at once
                    slot = self._replay_slots
                    await slot.acquire()
                await sub.start()
                if slot is not None and not getattr(sub, "backlog", 0):
                    slot.release()  # nothing replayed: waiting for live batches holds nothing
                    slot = None
                ahead = ReadAhead(sub, max_blocks=2 * self.drain_blocks)
                while items := await ahead.next(self.drain_batches):
                    resync = await self._handle_many(feed, items)
                    self._sync_stats(feed, sub)
                    failures = 0
                    if resync:
                        break
                    if slot is not None and _replayed_all(items, ahead, sub):
                        slot.release()
                        slot = None
                    if ahead.empty():
                        self.trimmer.caught_up()
            except asyncio.CancelledError:
                raise
            except Exception:
                failures += 1
                self.metrics.errors.labels(name).inc()
                log.exception("%s: event source failed", name)
                await asyncio.sleep(min(5.0, 0.1 * 2**failures))
            finally:
                if slot is not None:
                    slot.release()
                if ahead is not None:
                    await ahead.close()
                self._sync_stats(feed, sub)
                with contextlib.suppress(Exception):
                    await sub.close()
            if resync:
                start_seq, feed.resyncing = 0, True
            elif feed.last_seq is not None and feed.source.replay_endpoint:
                start_seq = feed.last_seq + 1  # source ended or failed: resume where we were
            else:
                start_seq = None

    async def _starting_point(self, feed: Feed, start_seq: int | None) -> int | None:
        """Where a new feed starts. A shared index that already holds the instance (a
        replica restarted while others kept ingesting, or within the heartbeat's TTL) is
        exact at once: replay from its cursor's batch -- the anchor: the publisher's copy
        must carry the cursor's ts, else the engine restarted since and the state is
        cleared and rebuilt -- rather than clearing and replaying. Otherwise rebuild from
        seq 0 (replay): nothing is known yet, so batches the buffer no longer has are
        only counted, as during a resync."""
        try:
            cursor = await self.index.cursor(feed.source.name)
        except Exception:
            cursor = None  # unreachable index: ingest retries and checks the cursor later
        if cursor is not None:
            feed.view.kept(cursor[1])
            feed.synced = True
            if not feed.source.replay_endpoint:
                return None  # nothing to check it against: the live stream continues it
            feed.anchor = cursor
            return cursor[1]
        feed.view.rebuild(0, "replay" if start_seq == 0 else "live")
        feed.resyncing = start_seq == 0
        return start_seq

    async def _handle_many(self, feed: Feed, items: list[SubscriberItem]) -> bool:
        """Handle subscriber items in order, each run of batches with one ``apply_many``;
        True asks for a resubscription from seq 0 (the rest of ``items`` is dropped with
        the subscriber, as a resubscription would deliver it again)."""
        if feed.anchor is not None and items:
            anchor, feed.anchor = feed.anchor, None
            first = items[0]
            if not isinstance(first, BatchReceived) or first.seq != anchor[1]:
                log.warning(
                    "%s: the index's batch %d is not replayable", feed.source.name, anchor[1]
                )
                return await self._resync(feed)
            if first.batch.ts != anchor[0]:
                log.warning("%s: restarted since the index's batch %d", feed.source.name, anchor[1])
                return await self._resync(feed)
            items = items[1:]  # the index's own last batch: already applied
        i = 0
        while i < len(items):
            first = items[i]
            if not isinstance(first, BatchReceived):
                if await self._handle(feed, first):
                    return True
                i += 1
                continue
            run: list[BatchReceived] = []
            blocks = 0
            for item in items[i:]:
                if not isinstance(item, BatchReceived) or (run and blocks >= self.drain_blocks):
                    break
                blocks += _blocks(item.batch)
                run.append(item)
            j = i + len(run)
            self.trimmer.applied(blocks)
            if await self._apply_run(feed, run):
                return True
            i = j
        return False

    async def _handle(self, feed: Feed, item: SourceRestarted | BatchesMissed) -> bool:
        """Handle one subscriber item other than a batch; True asks for a resubscription."""
        name = feed.source.name
        match item:
            case SourceRestarted(last_seq=last, new_seq=new):
                log.warning("%s: publisher restarted (seq %d -> %d)", name, last, new)
                self.metrics.restarts.labels(name).inc()
                feed.pending_reset = True
                feed.view.rebuild(0, "restart")  # the engine's cache starts empty
                return False
            case BatchesMissed(first_seq=first, last_seq=last):
                self.metrics.missed.labels(name).inc(last - first + 1)
                feed.view.missed(first, last)
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
            feed.view.cleared()
            return False
        feed.view.rebuild(0, "replay")
        feed.last_seq = None  # waiters wait for the rebuilt state, not the cleared one
        return True

    async def _apply_run(self, feed: Feed, recs: list[BatchReceived]) -> bool:
        """``BatchReceived`` items, in seq order: checked, applied with one ``apply_many``,
        counted one by one. A batch that fails (the index failed, or lost our state) is
        counted as ``error`` and forces a resync; without a replay endpoint the batches
        after it are then applied onto the cleared state, as they would have been one by
        one."""
        feed.resyncing = False
        batches, status = self._check(feed.source.name, recs)
        todo = [k for k, st in enumerate(status) if not st]
        if todo:
            await self._learn(feed, [(batches[k], recs[k].seq) for k in todo])
        counted = 0
        while todo:
            outcome = await self._store(feed, [(batches[k], recs[k].seq) for k in todo])
            for k, st in zip(todo, outcome, strict=False):
                status[k] = st
            failed = todo[len(outcome) - 1] if outcome[-1] == "error" else None
            upto = len(recs) if failed is None else failed + 1
            for k in range(counted, upto):
                self._count(feed, recs[k], batches[k], status[k])
            counted = upto
            if failed is None:
                if self.listener is not None:
                    self.listener.batch_applied(feed.source.name)
                return False
            if await self._resync(feed):
                return True
            todo = [k for k in todo if k > failed]
        for k in range(counted, len(recs)):  # only invalid ones are left
            self._count(feed, recs[k], batches[k], status[k])
        return False

    def _check(self, name: str, recs: list[BatchReceived]) -> tuple[list[KVEventBatch], list[str]]:
        """The batches to apply (impossible events dropped) and their status so far:
        ``invalid`` for an impossible ts -- applied, its (ts, seq) would make every later
        batch look stale -- else "" (to apply)."""
        batches, status = [], []
        for rec in recs:
            batch = rec.batch
            if not plausible_ts(batch.ts):
                log.warning("%s: batch %d with impossible ts %r dropped", name, rec.seq, batch.ts)
                status.append("invalid")
            else:
                if any_impossible(batch.events):
                    batch = self._drop_impossible(name, batch)
                status.append("")
            batches.append(batch)
        return batches, status

    async def _learn(self, feed: Feed, items: list[tuple[KVEventBatch, int]]) -> None:
        """Learn the group layout from each batch; share the newest with other routers."""
        name = feed.source.name
        learned = None
        for batch, seq in items:
            try:
                if self.layouts.observe(name, batch):
                    learned = self.layouts.learned(name)
                if self.listener is not None:
                    self.listener.batch_learned(name, batch)
            except Exception:  # never let odd geometry stop the feed; the index still learns
                self.metrics.errors.labels(name).inc()
                log.exception("%s: cannot learn from batch %d", name, seq)
        if learned is not None:
            with contextlib.suppress(Exception):
                await self.index.put_layout(name, learned.to_dict())

    async def _store(self, feed: Feed, items: list[tuple[KVEventBatch, int]]) -> list[str]:
        """Apply ``items`` in order (retrying): ``applied``/``stale`` per batch, cut short
        by an ``error`` at the first batch that failed or found our state gone."""
        name = feed.source.name
        for delay in (*self.retry_delays, None):
            # Once a batch was applied since the last clear, the index holds our cursor: a
            # batch that finds none means the index lost the instance (a Redis restarted
            # empty, a reaped heartbeat) -- rebuild from replay rather than onto nothing.
            synced = feed.synced and not feed.pending_reset
            try:
                results = await self.index.apply_many(name, items, reset=feed.pending_reset)
            except Exception:
                self.metrics.errors.labels(name).inc()
                log.exception("%s: applying batches %d..%d failed", name, items[0][1], items[-1][1])
                if delay is None:
                    break
                await asyncio.sleep(delay)
                continue
            feed.pending_reset = False
            feed.synced = True
            out = []
            for k, res in enumerate(results):
                if res.cursor_absent and (synced or k > 0):
                    log.warning("%s: the index lost this instance's state", name)
                    out.append("error")
                    break
                out.append("applied" if res.applied else "stale")
            return out
        return ["error"]

    def _count(self, feed: Feed, rec: BatchReceived, batch: KVEventBatch, status: str) -> None:
        """Per-batch metrics and progress (``last_seq``, ``wait_for_seq`` waiters)."""
        m = feed.metrics
        for kind, n in Counter(map(type, batch.events)).items():
            m.events(kind.__name__, status).inc(n)
        if rec.replayed:
            m.replay_batches.inc()
            m.replays.inc()
        else:
            m.live_batches.inc()
            if status != "invalid":
                lag = max(0.0, time.time() - batch.ts)
                m.lag.set(lag)
                m.lag_hist.observe(lag)
        feed.last_seq = rec.seq
        feed.view.applied(rec.seq)
        feed.handled += 1
        m.last_seq.set(rec.seq)
        feed.changed.set()

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
        assert self.heartbeat_s
        while True:
            await asyncio.sleep(self.heartbeat_s)
            for name in list(self._feeds):
                with contextlib.suppress(Exception):
                    await self.index.touch(name)
            reap = getattr(self.index, "reap", None)
            if reap is not None:
                with contextlib.suppress(Exception):
                    await reap()

    async def _watch_cursors(self) -> None:
        """Idle instances: a synced feed whose cursor vanished lost its state (a Redis that
        restarted empty, a reaped heartbeat); busy ones learn it from ``apply_many``."""
        assert self.cursor_check_s
        while True:
            await asyncio.sleep(self.cursor_check_s)
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


def _replayed_all(items: list[SubscriberItem], ahead: ReadAhead, sub: EventSource) -> bool:
    """The replay's answer is applied: a live batch came, or nothing is left to read."""
    if any(type(i) is BatchReceived and not i.replayed for i in items):
        return True
    return ahead.empty() and not getattr(sub, "backlog", 0)


def _blocks(batch: KVEventBatch) -> int:
    return sum(len(getattr(ev, "block_hashes", ())) for ev in batch.events)
