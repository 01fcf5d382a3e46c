"""A sharded index on a real Redis Cluster (3 masters + 3 replicas on loopback) loses a
master under load: the replica takes over, lookups keep being answered throughout, and
every instance's residency ends complete -- the instances on the failed shard rebuilt
from their publishers' replay buffers (the new master may lack batches the old one
acknowledged: replication is asynchronous)."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from events.publisher import ZmqEventPublisher
from events.structs import BlockStored, KVEventBatch
from router.index.redis_cluster import RedisClusterIndex, shard_of
from router.ingest import IngestManager
from stack.chaos.client import holds, metrics_text, new_client, scrape, send_completion, wait_for
from stack.procs import Fleet, free_port, start_engines
from stack.redis_cluster import RedisCluster, private_redis_cluster, wait_replicas_synced

NAMES = [f"e{i}" for i in range(6)]
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with private_redis_cluster(node_timeout_ms=1500) as c:
        yield c


def stored(*hashes: int) -> KVEventBatch:
    ev = BlockStored(list(hashes), None, [], 16, None, "GPU", None, group_idx=0)
    return KVEventBatch(ts=time.time(), events=[ev])


def _hashes(name: str, n: int) -> list[int]:
    base = (NAMES.index(name) + 1) << 32
    return [base + i for i in range(n)]


async def _complete(idx: RedisClusterIndex, published: dict[str, int], timeout: float) -> None:
    """Until every instance holds exactly the blocks its publisher sent (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        missing = {}
        for name, n in published.items():
            got = (await idx.lookup(_hashes(name, n), [name])).get(name, {}).get(0, 0)
            if got != (1 << n) - 1:
                missing[name] = n - got.bit_count()
        if not missing:
            return
        assert time.monotonic() < deadline, f"blocks missing after failover: {missing}"
        await asyncio.sleep(0.1)


async def test_master_killed_under_load_fails_over_and_the_index_is_rebuilt(cluster):
    tmp = Path(tempfile.mkdtemp(prefix="kvr-failover-"))
    pubs: dict[str, ZmqEventPublisher] = {}
    idx = RedisClusterIndex(cluster.url, namespace="kvr:{failover}", instance_ttl_s=None)
    reader = RedisClusterIndex(cluster.url, namespace="kvr:{failover}", instance_ttl_s=None)
    reg = CollectorRegistry()
    mgr = IngestManager(
        idx,
        registry=reg,
        retry_delays=(0.05, 0.1, 0.2, 0.5, 1.0),
        cursor_check_s=0.2,
    )
    published = dict.fromkeys(NAMES, 0)
    stop = asyncio.Event()
    answered: list[float] = []
    try:
        for name in NAMES:
            replay = f"tcp://127.0.0.1:{free_port()}"
            pubs[name] = ZmqEventPublisher(endpoint=f"ipc://{tmp / name}", replay_endpoint=replay)
            await mgr.add_instance(name, f"ipc://{tmp / name}", replay, start_seq=0)
        await reader._ready()
        assert reader.shards == 3
        assert len({shard_of(n, reader.shards) for n in NAMES}) > 1  # spread over shards

        async def publish() -> None:
            while not stop.is_set():
                for name, pub in pubs.items():
                    n = published[name]
                    pub.publish(stored(*_hashes(name, n + 4)[n:]))
                    published[name] = n + 4
                await asyncio.sleep(0.01)

        async def look() -> None:
            # Another router's lookups: never raise, answered all through the failover.
            while not stop.is_set():
                name = NAMES[len(answered) % len(NAMES)]
                await reader.lookup(_hashes(name, 64))
                answered.append(time.monotonic())
                await asyncio.sleep(0.005)

        tasks = [asyncio.create_task(publish()), asyncio.create_task(look())]
        await _wait(lambda: all((mgr.last_seq(n) or -1) >= 20 for n in NAMES), 30)
        victim = NAMES[0]
        k = shard_of(victim, reader.shards)
        master = cluster.master_of(reader._prefixes[k] + ":meta")
        on_shard = [n for n in NAMES if shard_of(n, reader.shards) == k]
        killed_at = time.monotonic()
        master.kill()
        await asyncio.to_thread(cluster.wait_healthy, 30)
        failed_over_s = time.monotonic() - killed_at
        assert cluster.master_of(reader._prefixes[k] + ":meta") is not master
        await asyncio.sleep(1.0)  # load keeps going on the new master
        stop.set()
        await asyncio.gather(*tasks)
        for name, pub in pubs.items():  # a last batch each, so a lost tail shows as a gap
            pub.publish(stored(*_hashes(name, published[name] + 1)[published[name] :]))
            published[name] += 1
        await _complete(reader, published, timeout=30)

        during = [t for t in answered if killed_at <= t <= killed_at + failed_over_s]
        log.info("failover took %.2f s; %d lookups answered meanwhile", failed_over_s, len(during))
        assert during, "no lookup was answered while the master was down"
        assert idx.failovers_seen >= 1
        for name in on_shard:  # their writes may have been lost: rebuilt from replay
            resyncs = reg.get_sample_value("kvroute_ingest_resyncs_total", {"instance": name})
            assert (resyncs or 0) >= 1, f"{name} on the failed shard was not rebuilt"
    finally:
        stop.set()
        await mgr.close()
        await idx.close()
        await reader.close()
        for pub in pubs.values():
            pub.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


async def _wait(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def _restart(cluster: RedisCluster, node) -> None:
    """Bring a killed node back: it rejoins (its nodes.conf) as a replica of the master
    that replaced it, so the next test again has a replica behind every master."""
    node.launch()
    node.wait_ready(15)
    cluster.wait_healthy(30)
    wait_replicas_synced(cluster.nodes, cluster.masters, timeout=30)


def _master_holding(cluster: RedisCluster, instance: str):
    """The node serving as master the shard that holds ``instance``'s cursor key."""
    import redis

    for p in cluster.nodes:
        if not p.alive:
            continue
        r = redis.Redis(host="127.0.0.1", port=p.port, socket_timeout=2)
        if r.info("replication").get("role") != "master":
            continue
        for key in r.scan_iter(match=f"*:i:{instance}", count=1000):
            return p, key.decode()
    raise AssertionError(f"no master holds {instance}'s state")


async def test_router_on_the_cluster_answers_every_request_through_a_failover(cluster, tmp_path):
    """A router (real process, two simulated engines) on ``--index redis+cluster://``:
    the master holding the cached probe's instance is killed under load; every request is
    answered, and the probe's residency is back on its holder after the failover (its
    shard's instances rebuilt from replay)."""
    _restart_all(cluster)
    with Fleet(tmp_path) as fleet:
        engines = start_engines(fleet, 2, "--profile", "swa-hybrid", "--time-scale", "20")
        router = fleet.router(engines, "--index", cluster.url)
        probe = f"history on a sharded index {uuid.uuid4().hex} " * 6
        stop = asyncio.Event()
        outcomes: list = []
        async with new_client(16) as client:
            r = await client.post(f"{router.url}/v1/completions", json={"prompt": probe})
            r.raise_for_status()
            holder = r.headers["x-kvroute-instance"]
            await wait_for(lambda: holds(client, router.url, probe, holder), 30, what="probe")

            async def worker(w: int) -> None:
                i = 0
                while not stop.is_set():
                    prompt = f"load {w}-{i} through a failover; " * (1 + i % 4)
                    outcomes.append(
                        await send_completion(client, router.url, len(outcomes), prompt, 4)
                    )
                    i += 1

            workers = [asyncio.create_task(worker(w)) for w in range(4)]
            try:
                await asyncio.sleep(1.0)
                master, key = _master_holding(cluster, holder)
                before = len(outcomes)
                master.kill()
                await asyncio.to_thread(cluster.wait_healthy, 30)
                during = len(outcomes) - before
                await wait_for(
                    lambda: holds(client, router.url, probe, holder), 30, what="probe rebuilt"
                )

                async def resynced() -> bool:
                    text = await metrics_text(client, router.url)
                    return scrape(text, "kvroute_ingest_resyncs_total", instance=holder) >= 1

                # The holder's next write after the master changed reports its state lost:
                # it comes with the load's next batch from that engine.
                await wait_for(resynced, 60, what="the holder's resync from replay")
            finally:
                stop.set()
                await asyncio.gather(*workers, return_exceptions=True)
            metrics = await metrics_text(client, router.url)
        lost = [o.describe() for o in outcomes if not o.ok]
        assert lost == [], "\n".join(lost)
        assert during > 0, "no request was answered during the failover"
        assert cluster.master_of(key) is not master
        assert scrape(metrics, "kvroute_ingest_resyncs_total", instance=holder) >= 1
        log.info("%d requests, %d during the failover, none lost", len(outcomes), during)


def _restart_all(cluster: RedisCluster) -> None:
    for p in cluster.nodes:
        if not p.alive:
            _restart(cluster, p)


async def test_replicas_share_over_the_cluster_and_move_off_a_node_that_dies(cluster):
    """Predict-on-route sharing on ``redis+cluster://`` (``ClusterPubSub``): two replicas
    on different nodes (cluster pub/sub is broadcast) see each other's records; the node
    the receiving replica subscribed on is killed, it moves to another node and sees the
    records published after."""
    from routerkit import eventually

    from router.prediction.shared import SharedPredictions

    _restart_all(cluster)
    ns = f"kvr:{{share-{uuid.uuid4().hex[:8]}}}"
    urls = [f"127.0.0.1:{p.port}" for p in cluster.nodes]
    ia = RedisClusterIndex("redis+cluster://" + ",".join(urls), namespace=ns)
    ib = RedisClusterIndex("redis+cluster://" + ",".join(urls[1:] + urls[:1]), namespace=ns)
    channel = f"{ns}:replicas"

    def replica(index: RedisClusterIndex) -> SharedPredictions:
        return SharedPredictions(
            index.pubsub_client(), channel, ttl_s=30.0, load=dict, set_peer_load=lambda _: None
        )

    a, b = replica(ia), replica(ib)
    killed = None
    try:
        await a.start()
        await b.start()
        assert ia.pubsub_client().node != ib.pubsub_client().node  # across nodes

        async def shared(key: int, hashes: list[int]) -> bool:
            a.record("http://e1", key, {0: hashes}, whole=0b1)  # again until it arrives
            return bool(b.residency(hashes, ["http://e1"]))

        await eventually(lambda: shared(1, [101, 102, 103]), timeout=10, interval=0.1)
        node = ib.pubsub_client().node
        assert node is not None
        killed = next(p for p in cluster.nodes if p.port == int(node.rsplit(":", 1)[1]))
        killed.kill()
        await eventually(lambda: shared(2, [201, 202]), timeout=30, interval=0.1)
        assert ib.pubsub_client().moves >= 1 and ib.pubsub_client().node != node
    finally:
        await a.close()
        await b.close()
        await ia.close()
        await ib.close()
        if killed is not None:
            await asyncio.to_thread(_restart, cluster, killed)
