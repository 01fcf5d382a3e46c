"""The index loses an instance's state (Redis restarted empty): requests keep flowing on
load alone, then the history is rebuilt from the publisher's replay buffer -- whether
batches arrived during the outage or the engine was idle."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import zmq
from prometheus_client import CollectorRegistry

from events.publisher import ZmqEventPublisher
from events.structs import BlockStored, KVEventBatch
from router.index import MemoryIndex
from router.ingest import IngestManager
from stack.chaos import Fleet, free_port, redis_outage


class VolatileIndex(MemoryIndex):
    """An index that can go away (every call fails) and come back empty, as a Redis with
    persistence off does after a restart."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def crash(self) -> None:
        self.down = True

    def restart_empty(self) -> None:
        MemoryIndex.__init__(self)
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("index unreachable")

    async def apply(self, instance, batch, *, seq=None, reset=False):
        self._check()
        return await super().apply(instance, batch, seq=seq, reset=reset)

    async def cursor(self, instance):
        self._check()
        return await super().cursor(instance)

    async def clear(self, instance):
        self._check()
        return await super().clear(instance)

    async def lookup(self, block_hashes, instances=None):
        self._check()
        return await super().lookup(block_hashes, instances)


def stored(*hashes: int) -> KVEventBatch:
    ev = BlockStored(list(hashes), None, [], 16, None, "GPU", None, group_idx=0)
    return KVEventBatch(ts=time.time(), events=[ev])


async def caught_up(mgr: IngestManager, pub: ZmqEventPublisher, seq: int) -> int:
    """Wait until ``seq`` is applied, publishing empty fillers (ZMQ's slow joiner may eat
    a batch; the next one reveals the gap and replay heals it). Returns the last seq."""
    deadline = time.monotonic() + 20
    while True:
        try:
            await mgr.wait_for_seq("e", seq, timeout=0.3)
            return seq
        except TimeoutError:
            assert time.monotonic() < deadline, f"ingest never reached seq {seq}"
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            seq += 1


async def _setup() -> tuple[VolatileIndex, ZmqEventPublisher, IngestManager, int, Path]:
    sock = Path(tempfile.mkdtemp(prefix="kvr-")) / "ev"
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(endpoint=f"ipc://{sock}", replay_endpoint=replay)
    index = VolatileIndex()
    mgr = IngestManager(
        index,
        registry=CollectorRegistry(),
        retry_delays=(0.05, 0.1, 0.2, 0.5, 1.0),  # ~2 s budget: the outage fits inside it
        cursor_check_s=0.1,
    )
    await mgr.add_instance("e", f"ipc://{sock}", replay, start_seq=0)
    seq = -1
    for h in range(1, 6):
        pub.publish(stored(h))
        seq += 1
    seq = await caught_up(mgr, pub, seq)
    assert (await index.lookup([1, 2, 3, 4, 5], ["e"]))["e"] == {0: 0b11111}
    return index, pub, mgr, seq, sock.parent


async def _rebuilt(index: VolatileIndex, hashes: list[int], timeout: float = 10.0) -> None:
    want = {0: (1 << len(hashes)) - 1}
    deadline = time.monotonic() + timeout
    while True:
        got = (await index.lookup(hashes, ["e"])).get("e")
        if got == want:
            return
        assert time.monotonic() < deadline, f"history not rebuilt: {got} != {want}"
        await asyncio.sleep(0.05)


async def test_index_restarted_empty_while_batches_arrive_is_rebuilt_from_replay():
    index, pub, mgr, seq, tmp = await _setup()
    try:
        index.crash()
        pub.publish(stored(6))  # applying fails; ingest retries
        await asyncio.sleep(0.3)
        index.restart_empty()  # back before the retries ran out: the retry would succeed
        pub.publish(stored(7))
        seq += 2
        await caught_up(mgr, pub, seq)
        await _rebuilt(index, [1, 2, 3, 4, 5, 6, 7])
    finally:
        await mgr.close()
        pub.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_index_restarted_empty_while_the_engine_is_idle_is_rebuilt_from_replay():
    index, pub, mgr, _, tmp = await _setup()
    try:
        index.crash()
        await asyncio.sleep(0.3)
        index.restart_empty()  # no batch arrives: only the cursor watchdog can notice
        await _rebuilt(index, [1, 2, 3, 4, 5])
    finally:
        await mgr.close()
        pub.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_resync_of_a_dead_source_clears_it_and_the_next_incarnation_starts_from_zero():
    """What the router does when an instance goes down: drop its residency now; whatever
    comes back (a restarted engine, sequence from 0) is all the index then knows."""
    index, pub, mgr, _, tmp = await _setup()
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    pub.shutdown()  # the engine died
    new = None
    try:
        mgr.resync("e")
        deadline = time.monotonic() + 10
        while await index.lookup([1, 2, 3, 4, 5], ["e"]):
            assert time.monotonic() < deadline, "residency of the dead source was kept"
            await asyncio.sleep(0.05)
        for _ in range(100):  # the same endpoints, once the old sockets let go
            try:
                new = ZmqEventPublisher(endpoint=endpoint, replay_endpoint=replay)
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        assert new is not None
        new.publish(stored(9))
        last = await caught_up(mgr, new, 0)  # may add empty fillers while ingest reconnects
        assert await index.lookup([1, 2, 3, 4, 5, 9], ["e"]) == {"e": {0: 1 << 5}}
        assert mgr.last_seq("e") == last  # the new incarnation's numbering
    finally:
        await mgr.close()
        if new is not None:
            new.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


async def test_redis_killed_under_load_loses_no_request_and_history_is_rebuilt(fleet: Fleet):
    r = await redis_outage(fleet, downtime_s=3.0, concurrency=4)
    assert r.requests_during_outage > 0
    assert r.lost == [], "\n".join(r.lost)
    assert r.fallback_seen, "lookups never failed: Redis was not really down"
    assert r.index_errors > 0
    # Cache-aware again, with the pre-outage prompt back on the instance that served it
    # (it was never sent again: only a replay from seq 0 can have restored it).
    holder = r.probe_holder
    assert sum(r.probe_view[holder]) > 0
    assert all(sum(v) == 0 for inst, v in r.probe_view.items() if inst != holder)
    assert all(n >= 1 for n in r.resyncs.values())
