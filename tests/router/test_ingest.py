"""Ingest: subscriber items -> index, with scripted sources and over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client import CollectorRegistry
from routerkit import (
    C0,
    G0,
    G1,
    PlayedSource,
    batch,
    catch_up,
    eventually,
    free_port,
    new_namespace,
    rebind,
    removed,
    stored,
)

from events.publisher import ZmqEventPublisher
from events.structs import KVEventBatch
from events.subscriber import BatchesMissed, BatchReceived, SourceRestarted
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.index import MemoryIndex
from router.index.redis_index import RedisIndex
from router.ingest import IngestManager, InstanceSource
from stack.procs import private_redis


class Sources:
    """Source factory recording every subscription, with the items to play on each."""

    def __init__(self, *scripts: list) -> None:
        self.scripts = list(scripts)
        self.made: list[PlayedSource] = []

    def __call__(self, source: InstanceSource, start_seq: int | None) -> PlayedSource:
        s = PlayedSource(self.scripts.pop(0) if self.scripts else [], source, start_seq)
        self.made.append(s)
        return s


def got(seq: int, b: KVEventBatch, replayed: bool = False) -> BatchReceived:
    return BatchReceived(seq=seq, batch=b, replayed=replayed)


def metric(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return reg.get_sample_value(name, labels) or 0.0


async def test_a_feed_shows_no_lag_until_its_first_live_batch():
    """The per-instance series are bound once per feed; the lag and last-seq gauges only
    at their first value: a feed that has only replayed has no lag to show, not 0."""
    idx, reg = MemoryIndex(), CollectorRegistry()
    sources = Sources([got(0, batch(stored([1, 2]), ts=time.time()), replayed=True)])
    mgr = IngestManager(idx, registry=reg, source_factory=sources)
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.wait_for_seq("e1", 0)
    assert metric(reg, "kvroute_ingest_batches_total", instance="e1", source="replay") == 1
    assert metric(reg, "kvroute_ingest_batches_total", instance="e1", source="live") == 0
    assert reg.get_sample_value("kvroute_ingest_lag_seconds", {"instance": "e1"}) is None
    assert reg.get_sample_value("kvroute_ingest_last_seq", {"instance": "e1"}) == 0.0  # set
    assert metric(reg, "kvroute_ingest_events_total", instance="e1", type="BlockStored",
                  status="applied") == 1  # fmt: skip
    await mgr.close()


async def test_batches_are_applied_in_order_and_counted_by_type_and_status():
    idx, reg = MemoryIndex(), CollectorRegistry()
    b0 = batch(stored([1, 2, 3]), stored([1], 1), ts=time.time() - 0.5)
    b1 = batch(removed([3]), ts=time.time())
    sources = Sources([got(0, b0), got(1, b1), got(1, b1, replayed=True)])
    mgr = IngestManager(idx, registry=reg, source_factory=sources)
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.wait_for_seq("e1", 1)
    await eventually(
        lambda: _async(metric(reg, "kvroute_ingest_batches_total", instance="e1", source="replay"))
    )
    assert (await idx.lookup([1, 2, 3]))["e1"] == {G0: 0b011, G1: 0b001}
    ev = "kvroute_ingest_events_total"
    assert metric(reg, ev, instance="e1", type="BlockStored", status="applied") == 2
    assert metric(reg, ev, instance="e1", type="BlockRemoved", status="applied") == 1
    assert metric(reg, ev, instance="e1", type="BlockRemoved", status="stale") == 1
    assert metric(reg, "kvroute_ingest_last_seq", instance="e1") == 1
    assert 0 <= metric(reg, "kvroute_ingest_lag_seconds", instance="e1") < 5
    assert metric(reg, "kvroute_ingest_replayed_batches_total", instance="e1") == 1
    await mgr.close()


async def test_every_batch_reaches_the_eviction_tracker():
    """Memory pressure is read from ingest's batches (``router.prediction.pressure``)."""
    from router.prediction.pressure import EvictionTracker

    idx, reg = MemoryIndex(), CollectorRegistry()
    tracker = EvictionTracker(window_s=3600.0)
    b0 = batch(stored([1, 2]), ts=time.time())
    b1 = batch(removed([9]), ts=time.time())  # e2 evicted
    sources = Sources([got(0, b0)], [got(0, b0), got(1, b1)])

    class Listener:  # router.ingest.IngestListener
        def batch_learned(self, instance: str, b: KVEventBatch) -> None:
            tracker.observe(instance, b)

        def batch_applied(self, instance: str) -> None:
            pass

    mgr = IngestManager(idx, registry=reg, source_factory=sources, listener=Listener())
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.add_instance("e2", "tcp://x:2")
    await mgr.wait_for_seq("e1", 0)
    await mgr.wait_for_seq("e2", 1)
    assert tracker.roomy("e1") and not tracker.roomy("e2")
    await mgr.close()


async def _async(value):
    return value


async def test_source_restart_resets_the_instance_with_the_next_batch():
    idx, reg = MemoryIndex(), CollectorRegistry()
    script = [
        got(0, batch(stored([1, 2]), ts=1.0)),
        got(1, batch(stored([3]), ts=1.1)),
        SourceRestarted(last_seq=1, new_seq=0),
        got(0, batch(stored([9]), ts=2.0)),
    ]
    mgr = IngestManager(idx, registry=reg, source_factory=Sources(script))
    await mgr.add_instance("e1", "tcp://x:1")
    await eventually(lambda: _async(idx.lookup_sync([1, 2, 3, 9]) == {"e1": {G0: 0b1000}}))
    assert metric(reg, "kvroute_ingest_restarts_total", instance="e1") == 1
    await mgr.close()


async def test_missed_batches_clear_then_rebuild_from_the_replay_buffer():
    idx, reg = MemoryIndex(), CollectorRegistry()
    first = [got(0, batch(stored([1, 2]), ts=1.0)), BatchesMissed(1, 4)]
    # Re-subscribed from seq 0: the buffer starts at 3, so 0..2 are reported missed again
    # (history, not a new loss), then 3..5 are replayed.
    second = [
        BatchesMissed(0, 2),
        got(3, batch(stored([5]), ts=1.3), replayed=True),
        got(4, batch(stored([6]), ts=1.4), replayed=True),
        got(5, batch(removed([5]), ts=1.5)),
    ]
    sources = Sources(first, second)
    mgr = IngestManager(idx, registry=reg, source_factory=sources)
    await mgr.add_instance("e1", "tcp://x:1", "tcp://x:2")
    await mgr.wait_for_seq("e1", 5)
    assert [s.start_seq for s in sources.made] == [None, 0]
    assert idx.lookup_sync([1, 2, 5, 6]) == {"e1": {G0: 0b1000}}
    assert metric(reg, "kvroute_ingest_missed_batches_total", instance="e1") == 4 + 3
    assert metric(reg, "kvroute_ingest_resyncs_total", instance="e1") == 1
    await mgr.close()


async def test_missed_batches_without_replay_clear_and_follow_the_live_stream():
    idx = MemoryIndex()
    script = [
        got(0, batch(stored([1, 2]), ts=1.0)),
        BatchesMissed(1, 1),
        got(2, batch(stored([7]), ts=1.2)),
    ]
    sources = Sources(script)
    mgr = IngestManager(idx, registry=CollectorRegistry(), source_factory=sources)
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.wait_for_seq("e1", 2)
    assert idx.lookup_sync([1, 2, 7]) == {"e1": {G0: 0b100}}
    assert len(sources.made) == 1
    await mgr.close()


async def test_removing_an_instance_stops_its_source_and_clears_only_it():
    idx = MemoryIndex()
    sources = Sources([got(0, batch(stored([1])))], [got(0, batch(stored([1, 2])))])
    mgr = IngestManager(idx, registry=CollectorRegistry(), source_factory=sources)
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.add_instance("e2", "tcp://x:2")
    with pytest.raises(ValueError):
        await mgr.add_instance("e1", "tcp://x:3")
    await mgr.wait_for_seq("e1", 0)
    await mgr.wait_for_seq("e2", 0)
    await mgr.remove_instance("e1")
    assert sources.made[0].closed
    assert mgr.instances() == ["e2"]
    assert idx.lookup_sync([1, 2]) == {"e2": {G0: 0b11}}
    await mgr.close()
    assert sources.made[1].closed


class FlakyIndex(MemoryIndex):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.touched: list[str] = []

    async def apply(self, instance, b, *, seq=None, reset=False):
        if self.failures:
            self.failures -= 1
            raise ConnectionError("index down")
        return await super().apply(instance, b, seq=seq, reset=reset)

    async def touch(self, instance: str) -> None:
        self.touched.append(instance)


async def test_index_errors_are_retried_and_never_stop_the_loop():
    idx, reg = FlakyIndex(failures=2), CollectorRegistry()
    script = [got(0, batch(stored([1]))), object(), got(1, batch(stored([2]), ts=2.0))]
    mgr = IngestManager(idx, registry=reg, source_factory=Sources(script), retry_delays=(0, 0))
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.wait_for_seq("e1", 1)
    assert idx.lookup_sync([1, 2]) == {"e1": {G0: 0b11}}
    assert metric(reg, "kvroute_ingest_errors_total", instance="e1") == 2
    await mgr.close()


async def test_an_index_that_keeps_failing_forces_a_resync():
    idx, reg = FlakyIndex(failures=3), CollectorRegistry()
    script = [got(0, batch(stored([1])))]
    sources = Sources(script, [got(0, batch(stored([1])), replayed=True)])
    mgr = IngestManager(idx, registry=reg, source_factory=sources, retry_delays=(0, 0))
    await mgr.add_instance("e1", "tcp://x:1", "tcp://x:2")
    await eventually(lambda: _async(len(sources.made) == 2))
    await eventually(lambda: _async(idx.lookup_sync([1]) == {"e1": {G0: 1}}))
    assert sources.made[1].start_seq == 0
    ev = "kvroute_ingest_events_total"
    assert metric(reg, ev, instance="e1", type="BlockStored", status="error") == 1
    await mgr.close()


async def test_layout_is_learned_shared_and_configurable():
    idx = FlakyIndex(0)
    layouts = LayoutRegistry()
    b = batch(stored([1], 0, kind="full_attention"), stored([1], 1, kind="mamba"))
    sources = Sources([got(0, b)], [got(0, batch(stored([1], 0)))])
    mgr = IngestManager(idx, layouts, registry=CollectorRegistry(), source_factory=sources)
    mgr_heartbeat = IngestManager(
        idx, registry=CollectorRegistry(), source_factory=Sources(), heartbeat_s=0.05
    )
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.add_instance("e2", "tcp://x:2", layout=InstanceLayout.full(32))
    await mgr.wait_for_seq("e1", 0)
    await mgr.wait_for_seq("e2", 0)
    shared = await idx.get_layouts()
    assert InstanceLayout.from_dict(shared["e1"]).groups[1].kind == "mamba"
    assert layouts.get("e2") == InstanceLayout.full(32)
    await mgr_heartbeat.add_instance("e3", "tcp://x:3")
    await eventually(lambda: _async("e3" in idx.touched))
    await mgr.remove_instance("e1")
    assert "e1" not in await idx.get_layouts() and layouts.get("e1") is None
    await mgr.close()
    await mgr_heartbeat.close()


class SlowCloseSource(PlayedSource):
    """A source whose close() swallows the caller's cancellation while it waits."""

    async def close(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.3)
        await super().close()


async def test_removing_an_instance_stops_it_even_if_its_source_swallows_a_cancel():
    idx = MemoryIndex()
    made: list[PlayedSource] = []

    def factory(source, start_seq):
        s = SlowCloseSource(source=source, start_seq=start_seq)
        s.items.put_nowait(BatchesMissed(0, 0))  # forces a resync: close, re-subscribe
        made.append(s)
        return s

    mgr = IngestManager(idx, registry=CollectorRegistry(), source_factory=factory)
    await mgr.add_instance("e1", "tcp://x:1", "tcp://x:2")
    await asyncio.sleep(0.1)  # the loop is now inside the slow close
    removal = asyncio.get_running_loop().create_task(mgr.remove_instance("e1"))
    done, _ = await asyncio.wait({removal}, timeout=4)
    assert removal in done, "remove_instance hung"
    count = len(made)
    await asyncio.sleep(0.5)
    assert len(made) == count <= 2  # nothing re-subscribes after removal
    await mgr.close()


class RecordingIndex(MemoryIndex):
    """Records each ``apply_many`` call's (seqs, reset) and counts ``cursor`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[list[int], bool]] = []
        self.cursor_calls = 0

    async def apply_many(self, instance, items, *, reset=False):
        self.calls.append(([seq for _, seq in items], reset))
        return await super().apply_many(instance, items, reset=reset)

    async def cursor(self, instance):
        self.cursor_calls += 1
        return await super().cursor(instance)


async def test_queued_batches_are_applied_together_in_order_and_counted_one_by_one():
    idx, reg = RecordingIndex(), CollectorRegistry()
    old = [got(i, batch(stored([100 + i]), ts=1.0 + i / 100)) for i in range(30)]
    new = [got(i, batch(stored([200 + i]), removed([200 + i - 1]), ts=5.0 + i)) for i in range(10)]
    script = [*old, SourceRestarted(last_seq=29, new_seq=0), *new]
    mgr = IngestManager(idx, registry=reg, source_factory=Sources(script), cursor_check_s=None)
    await mgr.add_instance("e1", "tcp://x:1")
    await eventually(lambda: _async(metric(reg, "kvroute_ingest_restarts_total", instance="e1")))
    await mgr.wait_for_seq("e1", 9)
    assert [seq for seqs, _ in idx.calls for seq in seqs] == [*range(30), *range(10)]
    assert len(idx.calls) < 40  # the backlog went in chunks, not one batch at a time
    # The reset travels with the new incarnation's first batch, and only with it.
    assert [(seqs[0], reset) for seqs, reset in idx.calls if reset] == [(0, True)]
    assert idx.calls[[r for _, r in idx.calls].index(True) - 1][0][-1] == 29
    assert idx.lookup_sync([129, 208, 209]) == {"e1": {G0: 0b100}}
    ev = "kvroute_ingest_events_total"
    assert metric(reg, ev, instance="e1", type="BlockStored", status="applied") == 40
    assert metric(reg, ev, instance="e1", type="BlockRemoved", status="applied") == 10
    assert metric(reg, "kvroute_ingest_batches_total", instance="e1", source="live") == 40
    assert idx.cursor_calls == 1  # at the feed's start (a kept state?), none per batch
    await mgr.close()


@pytest.mark.parametrize(("drain_batches", "drain_blocks", "largest"), [(4, 10_000, 4), (64, 7, 3)])
async def test_drained_chunks_are_bounded_by_batches_and_blocks(
    drain_batches, drain_blocks, largest
):
    idx = RecordingIndex()
    script = [got(i, batch(stored([3 * i, 3 * i + 1, 3 * i + 2]), ts=1.0 + i)) for i in range(24)]
    mgr = IngestManager(
        idx,
        registry=CollectorRegistry(),
        source_factory=Sources(script),
        drain_batches=drain_batches,
        drain_blocks=drain_blocks,
    )
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.wait_for_seq("e1", 23)
    sizes = [len(seqs) for seqs, _ in idx.calls]
    assert max(sizes) == largest
    assert [seq for seqs, _ in idx.calls for seq in seqs] == list(range(24))
    assert idx.lookup_sync(list(range(72))) == {"e1": {G0: (1 << 72) - 1}}
    await mgr.close()


async def test_a_batch_that_finds_its_state_gone_forces_a_rebuild_from_replay():
    """The index lost the instance behind ingest's back (a Redis restarted empty): the
    next batch reports it (no cursor check needed) and the history comes back."""
    idx, reg = RecordingIndex(), CollectorRegistry()
    first = [got(0, batch(stored([1]), ts=1.0)), got(1, batch(stored([2]), ts=1.1))]
    again = [got(s, batch(stored([s + 1]), ts=1.0 + s / 10), replayed=True) for s in range(3)]
    sources = Sources(first, again)
    mgr = IngestManager(idx, registry=reg, source_factory=sources, cursor_check_s=None)
    await mgr.add_instance("e1", "tcp://x:1", "tcp://x:2")
    await mgr.wait_for_seq("e1", 1)
    idx.clear_sync("e1")
    sources.made[0].items.put_nowait(got(2, batch(stored([3]), ts=1.2)))
    await eventually(lambda: _async(idx.lookup_sync([1, 2, 3]) == {"e1": {G0: 0b111}}))
    assert [s.start_seq for s in sources.made] == [None, 0]
    assert metric(reg, "kvroute_ingest_resyncs_total", instance="e1") == 1
    ev = "kvroute_ingest_events_total"
    assert metric(reg, ev, instance="e1", type="BlockStored", status="error") == 1
    assert idx.cursor_calls == 1  # the feed's start only
    await mgr.close()


async def test_a_failed_chunk_without_replay_clears_then_applies_the_batches_after_it():
    idx, reg = FlakyIndex(failures=3), CollectorRegistry()
    script = [
        got(0, batch(stored([1]), ts=1.0)),
        got(1, batch(stored([2]), stored([9], 5000), ts=1.1)),  # group 5000: impossible
        got(2, batch(stored([7]), ts=float("nan"))),
        got(3, batch(stored([3]), ts=1.3)),
    ]
    sources = Sources(script)
    mgr = IngestManager(idx, registry=reg, source_factory=sources, retry_delays=(0, 0))
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.wait_for_seq("e1", 3)
    assert idx.lookup_sync([1, 2, 3, 7, 9]) == {"e1": {G0: 0b110}}
    ev = "kvroute_ingest_events_total"
    assert metric(reg, ev, instance="e1", type="BlockStored", status="error") == 1
    assert metric(reg, ev, instance="e1", type="BlockStored", status="applied") == 2
    assert metric(reg, ev, instance="e1", type="BlockStored", status="invalid") == 2
    assert metric(reg, "kvroute_ingest_batches_total", instance="e1", source="live") == 4
    assert metric(reg, "kvroute_ingest_resyncs_total", instance="e1") == 1
    assert len(sources.made) == 1
    await mgr.close()


# ---- real sockets: events.publisher -> events.subscriber -> ingest -> index ----------------


@pytest.fixture
def endpoints():
    pub, rep = free_port(), free_port()
    # The publisher binds loopback explicitly (vLLM's rule would connect) and the
    # subscriber connects to the same addresses.
    return f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"


async def test_real_publisher_subscriber_path_feeds_the_index(index, endpoints):
    events, replay = endpoints
    pub = ZmqEventPublisher(endpoint=events, bind=True, replay_endpoint=replay, buffer_steps=100)
    mgr = IngestManager(index, registry=CollectorRegistry())
    try:
        pub.publish(batch(stored([1, 2, 3], 0), stored([2, 3], 1), ts=time.time()))
        pub.publish(batch(stored([3], 0, "CPU", block_size=0), ts=time.time()))
        # start_seq=0: what was published before we subscribed comes from replay.
        await mgr.add_instance("e1", events, replay, start_seq=0)
        await catch_up(mgr, "e1", pub, 1)
        pub.publish(batch(removed([2], 1), ts=time.time()))
        await catch_up(mgr, "e1", pub, 2)
        assert (await index.lookup([1, 2, 3]))["e1"] == {G0: 0b111, G1: 0b100, C0: 0b100}
        assert (await index.cursor("e1"))[1] >= 2
    finally:
        await mgr.close()
        pub.shutdown()


async def test_real_publisher_restart_drops_the_old_incarnation(index, endpoints):
    events, replay = endpoints
    reg = CollectorRegistry()
    mgr = IngestManager(index, registry=reg)
    old = ZmqEventPublisher(endpoint=events, bind=True, replay_endpoint=replay)
    try:
        for i in range(10):
            old.publish(batch(stored([100 + i]), ts=time.time()))
        await mgr.add_instance("e1", events, replay, start_seq=0)
        await catch_up(mgr, "e1", old, 9)
        assert len(await index.lookup(list(range(100, 110)))) == 1
    finally:
        old.shutdown()
    new = await rebind(events, replay)
    try:
        new.publish(batch(stored([7]), ts=time.time()))

        async def only_new():
            if await index.lookup([*range(100, 110), 7]) == {"e1": {G0: 1 << 10}}:
                return True
            new.publish(KVEventBatch(ts=time.time(), events=[]))
            await asyncio.sleep(0.1)
            return False

        await eventually(only_new)
        assert metric(reg, "kvroute_ingest_restarts_total", instance="e1") == 1
    finally:
        await mgr.close()
        new.shutdown()


async def test_two_routers_ingesting_one_source_into_redis_apply_each_batch_once(
    redis_server, endpoints
):
    events, replay = endpoints
    ns = new_namespace()
    idx_a, idx_b = (RedisIndex(redis_server.url, namespace=ns) for _ in range(2))
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    a, b = IngestManager(idx_a, registry=reg_a), IngestManager(idx_b, registry=reg_b)
    pub = ZmqEventPublisher(endpoint=events, bind=True, replay_endpoint=replay)
    try:
        for i in range(6):  # the same block stored three times, removed twice
            ev = stored([42]) if i % 2 == 0 else removed([42]) if i < 5 else stored([43])
            pub.publish(batch(ev, ts=time.time()))
        await a.add_instance("e1", events, replay, start_seq=0)
        await b.add_instance("e1", events, replay, start_seq=0)
        last = await catch_up(a, "e1", pub, 5)
        await catch_up(b, "e1", pub, last)
        assert (await idx_b.lookup([42, 43]))["e1"] == {G0: 0b11}  # refcount 3 - 2 = 1
        await a.wait_for_seq("e1", last)
        ev = "kvroute_ingest_events_total"
        applied = sum(
            metric(r, ev, instance="e1", type=t, status="applied")
            for r in (reg_a, reg_b)
            for t in ("BlockStored", "BlockRemoved")
        )
        assert applied == 6
        await idx_a.apply("e1", batch(removed([42]), ts=time.time()))
        assert (await idx_b.lookup([42, 43]))["e1"] == {G0: 0b10}
    finally:
        await a.close()
        await b.close()
        pub.shutdown()
        await idx_a.clear("e1")
        await idx_a.close()
        await idx_b.close()


async def test_redis_restarted_empty_mid_ingest_is_rebuilt_by_the_next_batch(endpoints):
    """FLUSHALL + SCRIPT FLUSH (a Redis restarted empty) while the engine publishes: the
    next batch's apply finds no cursor and ingest rebuilds from replay -- without the
    idle cursor watchdog."""
    events, replay = endpoints
    with private_redis() as server:
        idx = RedisIndex(server.url, namespace=new_namespace())
        reg = CollectorRegistry()
        mgr = IngestManager(idx, registry=reg, cursor_check_s=None)
        pub = ZmqEventPublisher(endpoint=events, bind=True, replay_endpoint=replay)
        try:
            for h in range(1, 6):
                pub.publish(batch(stored([h]), ts=time.time()))
            await mgr.add_instance("e1", events, replay, start_seq=0)
            seq = await catch_up(mgr, "e1", pub, 4)
            assert (await idx.lookup([1, 2, 3, 4, 5]))["e1"] == {G0: 0b11111}
            await idx.redis.flushall()
            await idx.redis.script_flush()
            pub.publish(batch(stored([6]), ts=time.time()))

            async def rebuilt():
                return await idx.lookup(list(range(1, 7))) == {"e1": {G0: 0b111111}}

            await eventually(rebuilt)
            await catch_up(mgr, "e1", pub, seq + 1)
            assert metric(reg, "kvroute_ingest_resyncs_total", instance="e1") >= 1
        finally:
            await mgr.close()
            pub.shutdown()
            await idx.close()
