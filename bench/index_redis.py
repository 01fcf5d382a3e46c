"""``kvroute bench index``, the Redis half: a private ``redis-server`` and the three Redis
ingest figures (see ``bench.index``'s docstring: per-batch ``apply``, pipelined
``apply_many``, and the whole publisher -> ZMQ -> ``IngestManager`` path)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from bench.index import PIPELINE_BATCHES, ingest_workload, stored_event
from events.structs import BlockStored, KVEventBatch
from router.index.memory import MemoryIndex
from stack import procs

__all__ = ["private_redis", "publisher_main", "redis_ingest"]


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A throw-away redis-server on a free port; yields its URL, stops it on exit."""
    with procs.private_redis() as server:
        yield server.url


async def redis_ingest(url: str, events: int, seed: int) -> dict[str, Any]:
    """The Redis ingest figures (module docstring), each into a fresh namespace, each
    checked against the in-memory index's final entry count."""
    from router.index.redis_index import RedisIndex, namespace_for

    batches, n = ingest_workload(events, seed)
    mem = MemoryIndex()
    for i, b in enumerate(batches):
        mem.apply_sync("bench", b, seq=i)
    want = mem.stats()["entries"]
    stores = [
        KVEventBatch(ts=b.ts, events=[e for e in b.events if type(e) is BlockStored])
        for b in batches
    ]
    n_stores = sum(len(e.block_hashes) for b in stores for e in b.events)
    out: dict[str, Any] = {}
    runs = (("apply", batches, n, 1), ("", batches, n, PIPELINE_BATCHES))
    for label, bs, blocks, depth in (*runs, ("stores_only", stores, n_stores, PIPELINE_BATCHES)):
        ridx = RedisIndex(url, namespace=namespace_for(f"bench-{label}", "sha256", "0"))
        await ridx.apply("warm", KVEventBatch(ts=0.0, events=[stored_event([1], 0)]))
        before = (await ridx.redis.info("memory"))["used_memory"]
        items = [(b, i) for i, b in enumerate(bs)]
        t0 = time.perf_counter()
        if depth == 1:
            for b, i in items:
                await ridx.apply("bench", b, seq=i)
        else:
            for k in range(0, len(items), depth):
                await ridx.apply_many("bench", items[k : k + depth])
        dt = time.perf_counter() - t0
        out["_".join(filter(None, ("ingest_redis", label, "per_s")))] = blocks / dt
        after = (await ridx.redis.info("memory"))["used_memory"]  # before scanning it
        if label != "stores_only":
            entries = (await ridx.stats())["entries"] - 1
            if entries != want:
                raise AssertionError(f"Redis ingest ({label or 'pipelined'}): {entries} != {want}")
        if label == "apply":
            out["redis_bytes_per_entry"] = (after - before) / max(entries, 1)
        await ridx.redis.flushdb()
        await ridx.close()
    out.update(await _manager_ingest(url, events, seed, batches, want))
    return out


def publisher_main(endpoint: str, replay: str, events: str, seed: str) -> None:
    """The ingest-path figure's engine side (a child process): publish an empty seq 0,
    print "ready", publish the workload as seq 1.. on the first line read from stdin,
    shut down on the second."""
    from events.publisher import ZmqEventPublisher

    batches, _ = ingest_workload(int(events), int(seed))
    pub = ZmqEventPublisher(
        endpoint=endpoint, replay_endpoint=replay, buffer_steps=len(batches) + 1
    )
    try:
        pub.publish(KVEventBatch(ts=0.0, events=[]))
        print("ready", flush=True)
        sys.stdin.readline()
        for b in batches:
            pub.publish(b)
        sys.stdin.readline()
    finally:
        pub.shutdown()


async def _manager_ingest(
    url: str, events: int, seed: int, batches: list[KVEventBatch], want: int
) -> dict[str, Any]:
    """Publisher process -> ZMQ -> subscriber -> ``IngestManager`` -> Redis, timed from
    the go signal to the last batch applied; the publisher makes ``batches`` again from
    (``events``, ``seed``)."""
    from prometheus_client import CollectorRegistry

    from router.index.redis_index import RedisIndex, namespace_for
    from router.ingest import IngestManager
    from stack.procs import free_port, ipc_endpoint

    n = sum(len(e.block_hashes) for b in batches for e in b.events)
    port = free_port()
    endpoint, replay = ipc_endpoint(f"bench-events-{port}"), f"tcp://127.0.0.1:{port}"
    code = "import sys; from bench.index_redis import publisher_main; publisher_main(*sys.argv[1:])"
    cmd = [sys.executable, "-c", code, endpoint, replay, str(events), str(seed)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    reg = CollectorRegistry()
    ridx = RedisIndex(url, namespace=namespace_for("bench-manager", "sha256", "0"))
    mgr = IngestManager(ridx, registry=reg)
    try:
        if (await asyncio.to_thread(proc.stdout.readline)).strip() != "ready":
            raise RuntimeError("the publisher process did not start")
        await mgr.add_instance("bench", endpoint, replay, start_seq=0)
        await mgr.wait_for_seq("bench", 0, timeout=30)
        await asyncio.sleep(0.3)  # the live subscription is in place before the burst
        t0 = time.perf_counter()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        await mgr.wait_for_seq("bench", len(batches), timeout=600)
        dt = time.perf_counter() - t0
        entries = (await ridx.stats())["entries"]
        if entries != want:
            raise AssertionError(f"Redis ingest (IngestManager): {entries} != {want}")

        def count(source: str) -> int:
            labels = {"instance": "bench", "source": source}
            return int(reg.get_sample_value("kvroute_ingest_batches_total", labels) or 0)

        return {
            "ingest_redis_manager_per_s": n / dt,
            "ingest_redis_manager_batches": {"live": count("live"), "replay": count("replay")},
        }
    finally:
        await mgr.close()
        await ridx.close()
        with contextlib.suppress(OSError):
            proc.stdin.write("stop\n")
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
