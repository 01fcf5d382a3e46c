"""Ingest holds a bounded amount decoded: the read-ahead stops at its block bound however
long the backlog, the heap is trimmed only after large backlogs, and the router's
subscribers never build an event's token ids."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from events.structs import BlockStored, KVEventBatch
from events.subscriber import BatchReceived
from router.index import MemoryIndex
from router.ingest import IngestManager, InstanceSource
from router.ingest.ahead import ReadAhead
from router.ingest.trim import HeapTrimmer


def _batch(n: int, base: int) -> KVEventBatch:
    ev = BlockStored(
        block_hashes=list(range(base, base + n)), parent_block_hash=None,
        token_ids=[], block_size=16, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    return KVEventBatch(ts=1.0, events=[ev])


class Backlog:
    """A source with ``count`` batches of ``blocks`` blocks ready at once; counts reads."""

    def __init__(self, count: int, blocks: int) -> None:
        self.count, self.blocks, self.read = count, blocks, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.read >= self.count:
            raise StopAsyncIteration
        self.read += 1
        return BatchReceived(self.read - 1, _batch(self.blocks, self.read * 1000), False)

    async def start(self) -> None: ...
    async def close(self) -> None: ...


async def test_read_ahead_stops_at_its_block_bound_and_delivers_everything_in_order():
    src = Backlog(count=500, blocks=100)
    ahead = ReadAhead(src, depth=1024, max_blocks=1000)
    for _ in range(20):  # let the reader run as far as it may
        await asyncio.sleep(0)
    assert src.read <= 1000 // 100 + 2  # the bound (plus the item in hand), not the depth
    seqs = []
    while items := await ahead.next(7):
        assert len(items) <= 7
        seqs += [i.seq for i in items]
    assert seqs == list(range(500))
    await ahead.close()


async def test_a_batch_larger_than_the_bound_still_passes():
    src = Backlog(count=3, blocks=5000)
    ahead = ReadAhead(src, max_blocks=1000)
    got = []
    while items := await ahead.next(10):
        got += items
    assert [i.seq for i in got] == [0, 1, 2]
    await ahead.close()


def test_heap_trim_runs_only_after_a_large_backlog_and_not_too_often():
    calls = []
    t = HeapTrimmer(min_blocks=1000, min_interval_s=3600)
    t._trim = lambda: calls.append(1)
    t.applied(999)
    t.caught_up()
    assert calls == []
    t.applied(1)
    t.caught_up()
    assert calls == [1] and t.trims == 1
    t.applied(10_000)
    t.caught_up()  # within the interval
    assert calls == [1]
    t._last = float("-inf")
    t.caught_up()
    assert calls == [1, 1]


async def test_the_router_subscribes_without_building_token_ids():
    mgr = IngestManager(
        MemoryIndex(), registry=CollectorRegistry(), heartbeat_s=None, cursor_check_s=None
    )
    sub = mgr._zmq_source(InstanceSource("a", "tcp://127.0.0.1:1"), None)
    assert sub.token_ids is False
    await sub.close()


class Replayed:
    """A source whose start answers a replay of ``count`` batches (``backlog``), then goes
    quiet (an idle engine); records how many of its kind were replaying at once."""

    active = 0
    most = 0

    def __init__(self, source: InstanceSource, start_seq: int | None, count: int = 20) -> None:
        self.name, self.count, self.sent = source.name, count, 0

    @property
    def backlog(self) -> int:
        return self.count - self.sent

    async def start(self) -> None:
        Replayed.active += 1
        Replayed.most = max(Replayed.most, Replayed.active)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.sent >= self.count:
            await asyncio.Event().wait()  # idle: no live batch ever
        await asyncio.sleep(0.001)
        self.sent += 1
        if self.sent == self.count:  # its whole replay handed over
            Replayed.active -= 1
        return BatchReceived(
            self.sent - 1, _batch(4, hash(self.name) % 10**9 + self.sent * 10), True
        )

    async def close(self) -> None: ...


async def test_cold_replays_run_a_few_at_a_time_and_idle_instances_never_hold_a_turn():
    Replayed.active = Replayed.most = 0
    mgr = IngestManager(
        MemoryIndex(),
        registry=CollectorRegistry(),
        source_factory=Replayed,
        heartbeat_s=None,
        cursor_check_s=None,
    )
    mgr.concurrent_replays = 3
    mgr._replay_slots = asyncio.Semaphore(3)
    names = [f"i{k}" for k in range(10)]
    for n in names:
        await mgr.add_instance(n, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", start_seq=0)
    for n in names:  # every instance replayed in full, though each stays idle afterwards
        await mgr.wait_for_seq(n, 19, timeout=30)
    assert 1 <= Replayed.most <= 3
    await mgr.close()
