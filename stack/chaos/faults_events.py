"""Scenario: event batches dropped on the wire between an engine and the router's ingest."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from stack.chaos.results import DroppedEventsResult
from stack.procs import LOOPBACK, free_port


class DropProxy:
    """SUB from a publisher, PUB to the router side, dropping the batches whose seq is in
    ``drop`` -- a lossy network between an engine and a router. Binds both sides on
    loopback (the publisher connects, as vLLM's publishers do to a collector)."""

    def __init__(self, upstream: str, downstream: str) -> None:
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.bind(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(downstream)
        self.drop: range = range(0)
        self.forwarded = 0
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            if len(frames) == 3 and int.from_bytes(frames[1], "big") in self.drop:
                self.dropped += 1
                continue
            await self.pub.send_multipart(frames)
            self.forwarded += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


class _EngineDriver:
    """An engine's KV cache (the real block pool, CPU tier included) on a random workload:
    shared prefixes, chunked prefills, decodes, evictions. Publishes each step's batch."""

    def __init__(self, profile: str, gpu_blocks: int, publisher: Any, seed: int) -> None:
        from engine_adapter.kv_cache_manager import KVCacheManager
        from engine_adapter.offload import OffloadConfig
        from engine_adapter.profiles import get_profile

        prof = get_profile(profile, sliding_window=64, page_bytes=32)
        offload = OffloadConfig(num_cpu_chunks=12, blocks_per_chunk=4)
        self.kv = KVCacheManager(prof, gpu_blocks, offload=offload, device="cpu")
        self.pub = publisher
        self.rng = random.Random(seed)
        self.prefixes = [
            [self.rng.randrange(50_000) for _ in range(self.rng.randrange(48, 200))]
            for _ in range(4)
        ]
        self.running: list[Any] = []
        self.published = 0  # == the publisher's next seq
        self.hashes: set[int] = set()  # every wire hash ever announced
        self.removals: list[int] = []  # BlockRemoved events per published batch (by seq)
        self._n = 0

    def publish(self, batch: Any) -> int:
        from events.structs import BlockRemoved, BlockStored

        for ev in batch.events:
            if type(ev) is BlockStored:
                self.hashes.update(ev.block_hashes)
        self.removals.append(sum(type(ev) is BlockRemoved for ev in batch.events))
        self.pub.publish(batch)
        self.published += 1
        return self.published - 1

    def filler(self) -> int:
        from events.structs import KVEventBatch

        return self.publish(KVEventBatch(ts=time.time(), events=[]))

    def step(self) -> int | None:
        """One engine step; the seq of its batch, or None when nothing changed."""
        rng, kv = self.rng, self.kv
        if len(self.running) < 3 and rng.random() < 0.7:
            base = rng.choice(self.prefixes) if rng.random() < 0.8 else []
            prompt = base + [rng.randrange(50_000) for _ in range(rng.randrange(1, 120))]
            req = kv.new_request(f"r{self._n}", prompt)
            self._n += 1
            gpu, cpu = kv.lookup(req)
            first = min(req.num_tokens - gpu - cpu, rng.choice([48, 96, 400])) or 1
            try:
                if kv.allocate_slots(req, first, gpu, cpu):
                    self.running.append(req)
            except LookupError:
                pass
        for req in list(self.running):
            left = req.num_tokens - req.num_computed_tokens
            if left > 0:
                ok = kv.allocate_slots(req, min(left, rng.choice([48, 96, 400])))
            elif rng.random() < 0.4:
                kv.free(req)
                self.running.remove(req)
                continue
            else:
                req.append_output_token_ids(rng.randrange(50_000))
                ok = kv.allocate_slots(req, 1)
            if not ok:  # out of blocks: preempt
                kv.free(req)
                self.running.remove(req)
        if rng.random() < 0.5:
            kv.flush()
        batch = kv.step_events()
        return None if batch is None else self.publish(batch)

    def finish(self) -> int:
        for req in self.running:
            self.kv.free(req)
        self.running.clear()
        self.kv.flush()
        batch = self.kv.step_events()
        return self.filler() if batch is None else self.publish(batch)

    def truth(self) -> set[tuple[int, int, int]]:
        """``(group, wire hash, tier)`` the engine holds (tier 0 GPU, 1 CPU)."""
        return {(g, h, 0 if m == "GPU" else 1) for (g, h, m), n in self.kv.residency().items() if n}


async def _index_entries(index: Any, name: str, hashes: set[int]) -> set[tuple[int, int, int]]:
    from router.index import NUM_TIERS

    order = sorted(hashes)
    found = (await index.lookup(order, [name])).get(name, {})
    out = set()
    for slot, mask in found.items():
        g, tier = divmod(slot, NUM_TIERS)
        out |= {(g, order[i], tier) for i in range(len(order)) if mask >> i & 1}
    return out


async def _caught_up(mgr: Any, name: str, engine: _EngineDriver, seq: int, timeout: float) -> None:
    """Wait until ``seq`` is applied; a batch lost to ZMQ's slow joiner is healed by
    replay once a later one arrives, so publish empty fillers while waiting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await mgr.wait_for_seq(name, seq, timeout=0.3)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
            seq = engine.filler()


async def dropped_events(
    *,
    drop: int = 20,
    buffer_steps: int = 10_000,
    steps: int = 150,
    seed: int = 0,
    profile: str = "swa-hybrid",
    gpu_blocks: int = 80,
) -> DroppedEventsResult:
    """One engine's events through a lossy proxy into ``IngestManager`` + ``MemoryIndex``;
    ``drop`` consecutive batches vanish mid-run. With ``buffer_steps`` larger than what
    follows, replay heals the gap; smaller, the instance must be cleared and rebuilt."""
    from prometheus_client import CollectorRegistry

    from events.publisher import ZmqEventPublisher
    from router.index import MemoryIndex
    from router.ingest import IngestManager

    up, down, rep = free_port(), free_port(), free_port()
    proxy = DropProxy(f"tcp://{LOOPBACK}:{up}", f"tcp://{LOOPBACK}:{down}")
    proxy.start()
    pub = ZmqEventPublisher(
        endpoint=f"tcp://{LOOPBACK}:{up}",
        replay_endpoint=f"tcp://{LOOPBACK}:{rep}",
        buffer_steps=buffer_steps,
    )
    engine = _EngineDriver(profile, gpu_blocks, pub, seed)
    index, reg = MemoryIndex(), CollectorRegistry()
    mgr = IngestManager(index, registry=reg, replay_timeout=2.0)
    name = "engine"
    try:
        await mgr.add_instance(
            name, f"tcp://{LOOPBACK}:{down}", f"tcp://{LOOPBACK}:{rep}", start_seq=0
        )
        await _caught_up(mgr, name, engine, engine.filler(), 30)
        for _ in range(steps // 3):
            engine.step()
        await _caught_up(mgr, name, engine, engine.filler(), 30)
        first = engine.published
        proxy.drop = range(first, first + drop)
        for _ in range(steps * 10):
            if engine.published >= first + drop:
                break
            engine.step()
        dropped_removals = sum(engine.removals[first : first + drop])
        # The next batch through reveals the gap: time until it (and the gap) is applied.
        t0 = time.monotonic()
        seq = engine.filler()
        await _caught_up(mgr, name, engine, seq, 30)
        recovery_s = time.monotonic() - t0
        # Right after the gap is handled: never stale (lost history may be missing).
        truth_at_gap, got_at_gap = engine.truth(), await _index_entries(index, name, engine.hashes)
        for _ in range(steps - steps // 3):
            engine.step()
        await _caught_up(mgr, name, engine, engine.finish(), 30)
        truth = engine.truth()
        got = await _index_entries(index, name, engine.hashes)

        def m(metric: str) -> float:
            return reg.get_sample_value(metric, {"instance": name}) or 0.0

        return DroppedEventsResult(
            buffer_steps=buffer_steps,
            replayable=buffer_steps > steps,
            dropped_removals=dropped_removals,
            recovery_s=recovery_s,
            stale_after_gap=len(got_at_gap - truth_at_gap),
            missing_after_gap=len(truth_at_gap - got_at_gap),
            injected=proxy.dropped,
            batches=engine.published,
            truth_entries=len(truth),
            index_entries=len(got),
            stale=len(got - truth),
            missing=len(truth - got),
            exact=got == truth,
            gaps=m("kvroute_ingest_gaps_total"),
            missed_batches=m("kvroute_ingest_missed_batches_total"),
            replayed_batches=m("kvroute_ingest_replayed_batches_total"),
            resyncs=m("kvroute_ingest_resyncs_total"),
        )
    finally:
        await mgr.close()
        pub.shutdown()
        await proxy.close()
        engine.kv.close()
