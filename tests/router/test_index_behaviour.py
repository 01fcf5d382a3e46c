"""One behaviour suite for every ``BlockIndex`` backend (memory, Redis, Redis Cluster), plus
the few behaviours only a shared Redis index has (namespaces, heartbeats, reclamation)."""

from __future__ import annotations

import asyncio
import random
import tracemalloc
from collections import Counter

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.crc import key_slot
from redis.exceptions import ResponseError
from routerkit import C0, C1, G0, G1, batch, new_namespace, positions, removed, stored

from events.structs import AllBlocksCleared
from router.index import MemoryIndex, Tier, open_index, slot_of
from router.index.instrumented import IndexMetrics, InstrumentedIndex
from router.index.redis_cluster import (
    RedisClusterIndex,
    parse_cluster_url,
    shard_of,
    shard_prefixes,
)
from router.index.redis_index import RedisIndex, namespace_for

H = [1000 + i for i in range(64)]


@pytest.fixture(params=["memory", "redis", "cluster"])
def backend(request: pytest.FixtureRequest) -> str:
    """Every test below taking ``index`` / ``make_index`` runs on each backend."""
    return request.param


async def test_stored_blocks_are_found_per_group_and_tier(index):
    await index.apply("a", batch(stored(H[:4], 0), stored(H[2:4], 1), stored(H[:2], 0, "CPU")))
    res = await index.lookup(H[:6])
    assert res == {"a": {G0: 0b1111, G1: 0b1100, C0: 0b11}}


async def test_lookup_masks_follow_request_positions_not_storage_order(index):
    await index.apply("a", batch(stored([H[5], H[1], H[3]])))
    res = await index.lookup([H[0], H[1], 999, H[3], H[5], H[1]])
    assert positions(res["a"][G0]) == [1, 3, 4, 5]
    assert await index.lookup([7, 8, 9]) == {}
    assert await index.lookup([]) == {}


async def test_medium_none_is_gpu_and_storage_counts_as_cpu(index):
    await index.apply("a", batch(stored(H[:2], None, None), stored(H[2:3], 0, "STORAGE")))
    assert (await index.lookup(H[:3]))["a"] == {G0: 0b11, C0: 0b100}


async def test_duplicate_stores_need_as_many_removes(index):
    await index.apply("a", batch(stored(H[:2]), stored(H[:1]), stored([H[0]])))
    await index.apply("a", batch(removed([H[0]]), removed([H[1]])))
    assert (await index.lookup(H[:2]))["a"] == {G0: 0b01}
    await index.apply("a", batch(removed([H[0]])))
    assert (await index.lookup(H[:2]))["a"] == {G0: 0b01}
    res = await index.apply("a", batch(removed([H[0]])))
    assert res.removed == 1
    assert await index.lookup(H[:2]) == {}


async def test_duplicate_hash_within_one_event_is_refcounted(index):
    await index.apply("a", batch(stored([H[0], H[0], H[1]])))
    await index.apply("a", batch(removed([H[0]])))
    assert (await index.lookup(H[:2]))["a"] == {G0: 0b11}
    await index.apply("a", batch(removed([H[0], H[1]])))
    assert await index.lookup(H[:2]) == {}


async def test_eviction_in_one_group_or_tier_leaves_the_others(index):
    await index.apply("a", batch(stored(H[:3], 0), stored(H[:3], 1), stored(H[:3], 0, "CPU")))
    await index.apply("a", batch(removed([H[1]], 1), removed([H[0]], 0, "CPU")))
    assert (await index.lookup(H[:3]))["a"] == {G0: 0b111, G1: 0b101, C0: 0b110}


async def test_removing_unknown_blocks_is_counted_and_harmless(index):
    await index.apply("a", batch(stored(H[:2])))
    res = await index.apply("a", batch(removed([H[5]]), removed([H[0]], 3), removed([H[1]])))
    assert res.unknown == 2 and res.removed == 1
    assert (await index.lookup(H[:2]))["a"] == {G0: 0b01}
    # A later store of a block whose removal was unknown works normally.
    await index.apply("a", batch(stored([H[5]])))
    assert (await index.lookup([H[5]]))["a"] == {G0: 1}


async def test_clear_one_instance_leaves_others_untouched(index):
    await index.apply("a", batch(stored(H[:4], 0), stored(H[:4], 1), stored(H[:4], 0, "CPU")))
    await index.apply("b", batch(stored(H[:3], 0), stored(H[1:2], 1)))
    await index.clear("a")
    assert await index.lookup(H[:4]) == {"b": {G0: 0b111, G1: 0b10}}
    assert await index.instances() == ["b"]
    assert await index.cursor("a") is None


async def test_clear_then_readd_starts_from_nothing(index):
    await index.apply("a", batch(stored(H[:4])), seq=5)
    await index.clear("a")
    await index.apply("a", batch(stored(H[2:3]), ts=0.5), seq=0)  # older ts: cursor was reset
    assert (await index.lookup(H[:4]))["a"] == {G0: 0b100}
    await index.clear("b")  # clearing an unknown instance is a no-op


async def test_columns_reused_after_clear_do_not_leak_old_bits(index):
    await index.apply("a", batch(stored(H[:8], 0), stored(H[:8], 1)))
    await index.clear("a")
    await index.apply("b", batch(stored(H[8:10], 0), stored(H[8:10], 1)))
    assert await index.lookup(H[:10]) == {"b": {G0: 0b11 << 8, G1: 0b11 << 8}}


async def test_all_blocks_cleared_drops_the_gpu_tier_of_that_instance_only(index):
    # vLLM's POST /reset_prefix_cache empties the GPU and sends AllBlocksCleared; its CPU
    # tier keeps serving hits (reset_external=false, the default).
    await index.apply("a", batch(stored(H[:3], 0), stored(H[:3], 1), stored(H[:2], 0, "CPU")))
    await index.apply("b", batch(stored(H[:1], 0, "CPU")))
    await index.apply("a", batch(stored([H[8]]), AllBlocksCleared(), stored([H[9]], 1)))
    assert await index.lookup([*H[:3], H[8], H[9]]) == {"a": {G1: 0b10000, C0: 0b11}, "b": {C0: 1}}
    # New CPU keys after the reset (what a kept tier stores next) leave it standing.
    await index.apply("a", batch(stored(H[2:4], 0, "CPU")))
    assert (await index.lookup(H[:4]))["a"] == {C0: 0b1111}


async def test_a_cpu_store_of_a_held_key_after_a_reset_means_the_cpu_tier_was_emptied(index):
    # reset_external=true empties vLLM's CPU tier too, with the same lone AllBlocksCleared;
    # vLLM never stores a CPU key it holds, so a store of one the index holds proves it.
    await index.apply("a", batch(stored(H[:4], 0, "CPU"), stored(H[:4], 1, "CPU")))
    await index.apply("b", batch(stored(H[:4], 0, "CPU")))
    await index.apply("a", batch(AllBlocksCleared()))
    assert (await index.lookup(H[:4]))["a"] == {C0: 0b1111, C1: 0b1111}
    # (A self-describing chunk may share leading blocks with a held sibling chunk: only
    # its key, the last hash, counts.)
    await index.apply("a", batch(stored([H[0], H[9]], 0, "CPU")))
    assert (await index.lookup(H[:4]))["a"] == {C0: 0b1111, C1: 0b1111}
    await index.apply("a", batch(stored(H[1:2], 0, "CPU")))
    got = await index.lookup(H[:4])
    assert got == {"a": {C0: 0b10}, "b": {C0: 0b1111}}  # b untouched
    # Confirmed once: a later duplicate store (vLLM's re-store after eviction it announced)
    # is an ordinary refcount again.
    await index.apply("a", batch(stored(H[1:3], 0, "CPU")))
    assert (await index.lookup(H[:4]))["a"] == {C0: 0b110}


async def test_a_publisher_restart_still_drops_every_tier(index):
    await index.apply("a", batch(stored(H[:2], 0), stored(H[:2], 0, "CPU")))
    await index.apply("a", batch(stored(H[4:5], 0)), reset=True)
    assert await index.lookup(H[:5]) == {"a": {G0: 0b10000}}


async def test_reset_drops_state_in_the_same_step_as_the_batch(index):
    await index.apply("a", batch(stored(H[:4]), ts=1.0), seq=7)
    res = await index.apply("a", batch(stored(H[4:5]), ts=2.0), seq=0, reset=True)
    assert res.applied and res.cleared >= 1
    assert (await index.lookup(H[:5]))["a"] == {G0: 0b10000}
    assert await index.cursor("a") == (2.0, 0)


async def test_batches_not_newer_than_the_cursor_are_skipped(index):
    assert (await index.apply("a", batch(stored(H[:1]), ts=1.0), seq=0)).applied
    assert (await index.apply("a", batch(stored(H[1:2]), ts=1.0), seq=1)).applied
    again = await index.apply("a", batch(stored(H[1:2]), ts=1.0), seq=1)
    older = await index.apply("a", batch(stored(H[2:3]), ts=0.5), seq=9)
    assert not again.applied and not older.applied
    assert (await index.lookup(H[:3]))["a"] == {G0: 0b11}
    # Without a seq a batch is applied unconditionally.
    assert (await index.apply("a", batch(removed([H[1]]), ts=0.1))).applied


async def test_two_ingesters_of_one_source_count_each_batch_once(make_index):
    first, second = make_index(), make_index()
    stream = [
        (0, batch(stored(H[:4]), ts=1.0)),
        (1, batch(stored(H[:2]), ts=1.1)),  # duplicate physical blocks: refcount 2
        (2, batch(removed(H[:1]), ts=1.2)),
    ]
    for seq, b in stream:
        await first.apply("a", b, seq=seq)
    for seq, b in stream:  # the second router lags behind and sees the same batches
        await second.apply("a", b, seq=seq)
    assert (await first.lookup(H[:4]))["a"] == {G0: 0b1111}
    await first.apply("a", batch(removed(H[:2]), ts=1.3), seq=3)
    assert (await second.lookup(H[:4]))["a"] == {G0: 0b1110}  # H1 still held once
    # The publisher restarts: both ingesters reset with the new incarnation's first batch,
    # but only the first reset takes effect.
    await first.apply("a", batch(stored(H[8:9]), ts=5.0), seq=0, reset=True)
    await first.apply("a", batch(stored(H[9:10]), ts=5.1), seq=1)
    await second.apply("a", batch(stored(H[8:9]), ts=5.0), seq=0, reset=True)
    await second.apply("a", batch(stored(H[9:10]), ts=5.1), seq=1)
    assert (await second.lookup(H[:10]))["a"] == {G0: 0b11 << 8}


async def test_bytes_hashes_are_keyed_by_their_low_64_bits(index):
    digest = bytes(range(24, 56))  # a 32-byte sha256-like digest
    wire = int.from_bytes(digest[-8:], "big")
    await index.apply("a", batch(stored([digest])))  # type: ignore[list-item]
    assert (await index.lookup([wire]))["a"] == {G0: 1}
    await index.apply("a", batch(removed([digest])))  # type: ignore[list-item]
    assert await index.lookup([wire]) == {}


async def test_hashes_above_2_pow_63_round_trip(index):
    big = [(1 << 64) - 1, 1 << 63, (1 << 63) + 12345]
    await index.apply("a", batch(stored(big)))
    assert (await index.lookup(big))["a"] == {G0: 0b111}


async def test_lookup_can_be_restricted_to_candidate_instances(index):
    for name in ("a", "b", "c"):
        await index.apply(name, batch(stored(H[:2])))
    res = await index.lookup(H[:2], ["a", "c", "zz"])
    assert set(res) == {"a", "c"}
    assert await index.lookup(H[:2], []) == {}


async def test_instances_lists_instances_with_state(index):
    assert await index.instances() == []
    await index.apply("b", batch(stored(H[:1])))
    await index.apply("a", batch(stored(H[:1])), seq=0)
    assert sorted(await index.instances()) == ["a", "b"]
    assert await index.cursor("a") == (1.0, 0)


async def test_layouts_are_shared_through_the_index(make_index):
    writer, reader = make_index(), make_index()
    layout = {"groups": [{"kind": "full_attention", "block_size": 16, "sliding_window": None}]}
    await writer.put_layout("a", layout)
    assert await reader.get_layouts() == {"a": layout}
    await writer.put_layout("a", None)
    assert await reader.get_layouts() == {}


async def test_concurrent_ingest_and_lookups_end_in_the_right_state(index):
    async def ingest(name: str, offset: int) -> None:
        for i in range(20):
            await index.apply(name, batch(stored([offset + i], i % 2), ts=float(i)), seq=i)
            if i % 5 == 4:
                await index.apply(name, batch(removed([offset + i - 2], (i - 2) % 2)))

    async def read() -> None:
        for _ in range(20):
            await index.lookup(list(range(100, 140)))
            await asyncio.sleep(0)

    await asyncio.gather(ingest("a", 100), ingest("b", 120), read(), read())
    res = await index.lookup(list(range(100, 140)))
    for name, off in (("a", 100), ("b", 120)):
        gone = {off + i - 2 for i in range(20) if i % 5 == 4}
        want_g0 = [i for i in range(20) if i % 2 == 0 and off + i not in gone]
        want_g1 = [i for i in range(20) if i % 2 == 1 and off + i not in gone]
        assert positions(res[name].get(G0, 0)) == [off - 100 + i for i in want_g0]
        assert positions(res[name].get(G1, 0)) == [off - 100 + i for i in want_g1]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_event_streams_match_a_reference_model(index, seed):
    rng = random.Random(seed)
    universe = list(range(5000, 5040))
    refs: Counter[tuple[str, int, int]] = Counter()
    cols: set[tuple[str, int]] = set()  # (instance, slot) columns that exist
    unconfirmed: set[str] = set()  # CPU tiers an AllBlocksCleared left standing

    def drop(name: str, tier: int | None) -> None:
        for key in [k for k in refs if k[0] == name and tier in (None, k[1] % 2)]:
            del refs[key]
        cols.difference_update([c for c in cols if c[0] == name and tier in (None, c[1] % 2)])

    for step in range(120):
        name = rng.choice("abc")
        events, kind = [], rng.random()
        group, medium = rng.randrange(2), rng.choice(["GPU", "CPU"])
        slot = slot_of(group, Tier.GPU if medium == "GPU" else Tier.CPU)
        hs = rng.sample(universe, rng.randint(1, 6))
        if kind < 0.55:
            events.append(stored(hs, group, medium))
            if name in unconfirmed and medium == "CPU" and refs[(name, slot, hs[-1])]:
                drop(name, Tier.CPU)  # vLLM re-stored a key it held: its CPU tier was reset
                unconfirmed.discard(name)
            refs.update((name, slot, h) for h in hs)
            cols.add((name, slot))
        elif kind < 0.93:
            events.append(removed(hs, group, medium))
            for h in hs:
                if refs[(name, slot, h)] > 0:
                    refs[(name, slot, h)] -= 1
        elif kind < 0.97:
            events.append(AllBlocksCleared())
            drop(name, Tier.GPU)
            if any(c[0] == name for c in cols):
                unconfirmed.add(name)
        else:
            await index.clear(name)
            drop(name, None)
            unconfirmed.discard(name)
            continue
        await index.apply(name, batch(*events, ts=float(step)), seq=step)
    want: dict[str, dict[int, int]] = {}
    for (name, slot, h), n in refs.items():
        if n > 0:
            masks = want.setdefault(name, {})
            masks[slot] = masks.get(slot, 0) | 1 << universe.index(h)
    assert await index.lookup(universe) == want


def _random_stream(seed: int, n: int) -> list:
    """(batch, seq) items over a small universe: duplicate stores, removals (some of
    unknown blocks), group/tier mixes, an AllBlocksCleared, and stale re-deliveries."""
    rng = random.Random(seed)
    universe = list(range(7000, 7030))
    items = []
    for step in range(n):
        events = []
        for _ in range(rng.randint(1, 4)):
            group, medium = rng.randrange(2), rng.choice(["GPU", "CPU"])
            hs = [rng.choice(universe) for _ in range(rng.randint(1, 5))]
            events.append((stored if rng.random() < 0.6 else removed)(hs, group, medium))
        if step == n // 2:
            events.append(AllBlocksCleared())
        items.append((batch(*events, ts=float(step)), step))
        if step % 7 == 6:
            items.append(items[-3])  # a re-delivery: stale
    return items


@pytest.mark.parametrize("chunk", [1, 3, 16])
async def test_apply_many_equals_applying_each_batch_in_turn(index, chunk):
    items = _random_stream(chunk, 60)
    await index.apply("a", batch(stored(H[:3]), ts=-1.0), seq=0)  # the reset drops it
    await index.apply("b", batch(stored(H[:3]), ts=-1.0), seq=0)
    one_by_one = [await index.apply("b", b, seq=s, reset=k == 0) for k, (b, s) in enumerate(items)]
    many = []
    for k in range(0, len(items), chunk):
        many += await index.apply_many("a", items[k : k + chunk], reset=k == 0)

    def counts(r):
        return (r.applied, r.stored, r.removed, r.unknown, r.cleared)

    assert [counts(r) for r in many] == [counts(r) for r in one_by_one]
    assert sum(not r.applied for r in many) >= 8  # the stale re-deliveries were skipped
    res = await index.lookup([*H[:3], *range(7000, 7030)])
    assert res.get("a") == res.get("b") and res.get("a")
    assert await index.cursor("a") == await index.cursor("b") == (59.0, 59)


async def test_apply_many_with_nothing_to_apply_does_nothing(index):
    assert await index.apply_many("a", []) == []
    assert await index.instances() == []


async def test_apply_many_flags_a_batch_that_found_no_cursor(index):
    first = await index.apply_many("a", [(batch(stored(H[:1]), ts=1.0), 0), (batch(), 1)])
    assert [r.cursor_absent for r in first] == [True, False]
    again = await index.apply_many("a", [(batch(ts=1.0), 1), (batch(ts=1.0), 2)])
    assert [(r.applied, r.cursor_absent) for r in again] == [(False, False), (True, False)]
    await index.clear("a")  # what a Redis restarted empty looks like to the ingester
    lost = await index.apply_many("a", [(batch(stored(H[1:2]), ts=1.0), 3)])
    assert lost[0].applied and lost[0].cursor_absent
    unseq = await index.apply_many("b", [(batch(stored(H[:1])), None)])
    assert not unseq[0].cursor_absent  # without a seq there is no cursor to expect


async def test_two_ingesters_pipelining_one_source_count_each_batch_once(make_index):
    first, second = make_index(), make_index()
    stream = [
        (batch(stored(H[:4]), ts=1.0), 0),
        (batch(stored(H[:2]), ts=1.1), 1),  # refcount 2
        (batch(removed(H[:1]), ts=1.2), 2),
        (batch(stored(H[4:6]), ts=1.3), 3),
        (batch(removed(H[1:2], 0), removed(H[4:5]), ts=1.4), 4),
    ]
    a = await first.apply_many("e", stream[:3])
    b = await second.apply_many("e", stream[1:])  # overlaps: 1 and 2 already applied
    assert [r.applied for r in a] == [True, True, True]
    assert [r.applied for r in b] == [False, False, True, True]
    assert not any(r.cursor_absent for r in b)
    c = await first.apply_many("e", stream)  # the first one catches up: all stale
    assert not any(r.applied for r in c)
    # H0 and H1 held twice, each released once; H4 released; H2, H3, H5 held.
    assert (await first.lookup(H[:6]))["e"] == {G0: 0b101111}
    assert await second.cursor("e") == (1.4, 4)


# ---- memory backend ---------------------------------------------------------------------


def test_memory_index_stays_under_150_bytes_per_resident_entry():
    tracemalloc.start()
    try:
        idx = MemoryIndex()
        base = tracemalloc.get_traced_memory()[0]
        rng = random.Random(0)
        n = 0
        for step in range(100):  # 2 instances x 2 groups, half their blocks shared
            shared = [rng.getrandbits(64) for _ in range(250)]
            for name in ("a", "b"):
                own = [rng.getrandbits(64) for _ in range(250)]
                b = batch(stored(shared + own, 0), stored(own, 1), ts=float(step))
                idx.apply_sync(name, b, seq=step)
                n += 750
        del b, shared, own
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert idx.stats()["entries"] == n
    assert used / n <= 150, f"{used / n:.1f} bytes per entry"


# ---- Redis backend ----------------------------------------------------------------------


def test_open_index_picks_the_backend_from_the_url():
    assert isinstance(open_index(None), MemoryIndex)
    assert isinstance(open_index("memory://"), MemoryIndex)
    for url in ("redis://h:1/0", "rediss://h:1/0", "unix:///tmp/x.sock"):
        assert isinstance(open_index(url), RedisIndex)
    assert isinstance(open_index("redis+cluster://h:1,h:2"), RedisClusterIndex)
    with pytest.raises(ValueError):
        open_index("etcd://x")


# ---- Redis Cluster backend ----------------------------------------------------------------


def test_cluster_url_names_nodes_and_shards_and_rejects_the_rest():
    assert parse_cluster_url("redis+cluster://a:1,b:2/?shards=6") == (
        [("a", 1), ("b", 2)],
        {"shards": "6"},
    )
    for bad in ("redis+cluster://a", "redis+cluster://a:1?x=1", "redis+cluster://a:1?shards=0"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def test_cluster_shard_tags_fall_into_equal_slot_ranges():
    """With shards a multiple of the masters, ``--cluster create``'s equal slot ranges give
    every master the same number of shards."""
    prefixes = shard_prefixes("kvr:{abc}", 6)
    assert len(set(prefixes)) == 6
    slots = [key_slot(p.encode()) for p in prefixes]
    assert [s * 6 // 16384 for s in slots] == list(range(6))
    assert all(p.startswith("kvr:{abc.") for p in prefixes)


async def test_cluster_spreads_instances_over_every_master_one_shard_each(redis_cluster):
    idx = RedisClusterIndex(redis_cluster.url, namespace=new_namespace())
    try:
        names = [f"inst{i}" for i in range(12)]
        for i, name in enumerate(names):
            await idx.apply(name, batch(stored(H[i : i + 4])))
        assert idx.shards == 3  # one per master by default
        assert {shard_of(n, idx.shards) for n in names} == {0, 1, 2}
        masters = {redis_cluster.master_of(p + ":meta").port for p in idx._prefixes}
        assert len(masters) == 3
        res = await idx.lookup(H[:16])
        assert sorted(res) == sorted(names)
        assert all(positions(res[n][G0]) == list(range(i, i + 4)) for i, n in enumerate(names))
    finally:
        await idx.close()


async def test_cluster_shard_count_is_fixed_by_the_first_router(redis_cluster):
    ns = new_namespace()
    first = RedisClusterIndex(redis_cluster.url + "/?shards=6", namespace=ns)
    second = RedisClusterIndex(redis_cluster.url, namespace=ns)
    try:
        await first.apply("a", batch(stored(H[:2])))
        assert (await second.lookup(H[:2])) == {"a": {G0: 0b11}}
        assert first.shards == second.shards == 6
    finally:
        await first.close()
        await second.close()


def test_namespace_separates_models_hash_algorithms_and_seeds():
    names = {
        namespace_for("m", "sha256", "0"),
        namespace_for("m", "sha256_cbor", "0"),
        namespace_for("m", "sha256", "1"),
        namespace_for("other", "sha256", "0"),
    }
    assert len(names) == 4
    assert namespace_for("m", "sha256", "0") == namespace_for("m", "sha256", "0")


async def test_redis_namespaces_never_mix(redis_server):
    a = RedisIndex(redis_server.url, model="m", hash_algo="sha256", hash_seed="0")
    b = RedisIndex(redis_server.url, model="m", hash_algo="sha256_cbor", hash_seed="0")
    try:
        before = {k async for k in a.redis.scan_iter(match="*")}
        await a.apply("x", batch(stored(H[:2])))
        assert await b.lookup(H[:2]) == {}
        assert await b.instances() == []
        new = {k async for k in a.redis.scan_iter(match="*")} - before
        assert new and all(k.startswith(a.prefix.encode() + b":") for k in new)
    finally:
        await a.clear("x")
        await a.close()
        await b.close()


async def test_redis_apply_is_one_round_trip_per_batch(redis_server, monkeypatch):
    idx = RedisIndex(redis_server.url, namespace=new_namespace())
    try:
        await idx.apply("a", batch(stored(H[:1])))  # loads the script, writes the description
        sent: list[object] = []
        real = idx.redis.execute_command

        async def counting(*args, **kw):
            sent.append(args[0])
            return await real(*args, **kw)

        monkeypatch.setattr(idx.redis, "execute_command", counting)
        big = batch(*[stored(H[i : i + 4], i % 3) for i in range(0, 60, 4)], removed(H[:3]))
        await idx.apply("a", big, seq=1)
        assert sent == ["EVALSHA"]
        sent.clear()
        await idx.lookup(H)
        assert sent == ["EVALSHA"]
    finally:
        await idx.close()


async def test_redis_apply_many_is_one_round_trip_for_many_batches(redis_server, monkeypatch):
    idx = RedisIndex(redis_server.url, namespace=new_namespace())
    try:
        await idx.apply("a", batch(stored(H[:1])))  # writes the namespace description
        wire: list[str] = []
        send, read = aioredis.Connection.send_packed_command, aioredis.Connection.read_response

        async def sending(self, *args, **kw):
            wire.append("send")
            return await send(self, *args, **kw)

        async def reading(self, *args, **kw):
            wire.append("read")
            return await read(self, *args, **kw)

        monkeypatch.setattr(aioredis.Connection, "send_packed_command", sending)
        monkeypatch.setattr(aioredis.Connection, "read_response", reading)
        items = [(batch(stored(H[i : i + 2], i % 2), ts=2.0), i) for i in range(16)]
        res = await idx.apply_many("a", items)
        # Everything is sent before the first reply is awaited: one round trip.
        assert "".join(w[0] for w in wire) == "s" * 17 + "r" * 17
        assert [r.applied for r in res] == [True] * 16
        assert (await idx.lookup(H[:17]))["a"] == {G0: (1 << 16) - 1, G1: (1 << 17) - 2}
    finally:
        await idx.close()


async def test_redis_apply_many_error_fails_the_call_and_leaves_the_connection_usable(
    redis_server,
):
    idx = RedisIndex(redis_server.url, namespace=new_namespace())
    try:
        await idx.redis.set(f"{idx.prefix}:i:a", b"not a hash")  # the script's HMGET fails
        items = [(batch(stored(H[:1]), ts=1.0), 0), (batch(stored(H[1:2]), ts=1.0), 1)]
        with pytest.raises(ResponseError):
            await idx.apply_many("a", items)
        await idx.redis.delete(f"{idx.prefix}:i:a")
        res = await idx.apply_many("a", items)
        assert [r.applied for r in res] == [True, True]
        assert (await idx.lookup(H[:2]))["a"] == {G0: 0b11}
    finally:
        await idx.close()


async def test_redis_apply_many_after_the_script_cache_was_flushed(redis_server):
    """A Redis restarted empty has forgotten the scripts; no call of the pipeline may fail
    with NOSCRIPT (and run out of order)."""
    idx = RedisIndex(redis_server.url, namespace=new_namespace())
    try:
        await idx.apply_many("a", [(batch(stored(H[:1]), ts=1.0), 0), (batch(ts=1.0), 1)])
        await idx.redis.script_flush()
        res = await idx.apply_many(
            "a", [(batch(stored(H[1:2]), ts=2.0), 2), (batch(removed(H[:1]), ts=2.0), 3)]
        )
        assert [r.applied for r in res] == [True, True]
        assert (await idx.lookup(H[:2]))["a"] == {G0: 0b10}
    finally:
        await idx.close()


async def test_redis_release_keeps_the_bitmap_of_other_holders(redis_server):
    """A released block whose bitmap other columns share keeps their bits (the bitmap is
    taken and put back), and disappears with its last holder."""
    idx = RedisIndex(redis_server.url, namespace=new_namespace())
    try:
        for name in ("a", "b", "c"):
            await idx.apply(name, batch(stored(H[:2], 0), stored(H[:2], 1)))
        await idx.apply("b", batch(removed(H[:1], 0), removed(H[:2], 1)))
        res = await idx.lookup(H[:2])
        assert res == {
            "a": {G0: 0b11, G1: 0b11},
            "b": {G0: 0b10},
            "c": {G0: 0b11, G1: 0b11},
        }
        for name in ("a", "b", "c"):
            await idx.apply(name, batch(removed(H[:2], 0), removed(H[:2], 1)))
        assert await idx.lookup(H[:2]) == {}
        assert [k async for k in idx.redis.scan_iter(match=f"{idx.prefix}:b:*")] == []
    finally:
        await idx.close()


async def test_redis_emptied_under_a_reader_never_credits_one_instance_with_anothers_blocks(
    redis_server,
):
    """Redis restarted empty: columns are handed out again from 0 and the column map
    version counts up to the very number a reader cached. The reader must still see the
    new map (the version carries an epoch), not its cached column -> instance one."""
    namespace = new_namespace()
    reader = RedisIndex(redis_server.url, namespace=namespace)
    writer = RedisIndex(redis_server.url, namespace=namespace)
    try:
        await writer.apply("a", batch(stored(H[:1], 0)))  # column 0 = a
        await writer.apply("b", batch(stored(H[1:2], 0)))  # column 1 = b
        assert await reader.lookup(H[:2]) == {"a": {G0: 0b01}, "b": {G0: 0b10}}
        keys = [k async for k in writer.redis.scan_iter(match=f"{writer.prefix}:*")]
        await writer.redis.delete(*keys)  # what a restart with persistence off leaves
        await writer.apply("b", batch(stored(H[1:2], 0)))  # column 0 = b now
        await writer.apply("a", batch(stored(H[:1], 0)))  # column 1 = a
        assert await reader.lookup(H[:2]) == {"a": {G0: 0b01}, "b": {G0: 0b10}}
    finally:
        await reader.close()
        await writer.close()


async def test_redis_clear_reclaims_every_key_of_the_instance(redis_server):
    idx = RedisIndex(redis_server.url, namespace=new_namespace())
    try:
        await idx.apply("keep", batch(stored(H[:3])))
        r = idx.redis
        baseline = {k async for k in r.scan_iter(match=f"{idx.prefix}:*")}
        rng = random.Random(1)
        hs = [rng.getrandbits(64) for _ in range(3000)]
        await idx.apply("a", batch(stored(hs, 0), stored(hs[:500], 1), stored(H[:3], 1)))
        await idx.apply("a", batch(stored(hs[:100], 0)))  # refcount 2 entries
        assert len([k async for k in r.scan_iter(match=f"{idx.prefix}:b:*")]) == 3003
        await idx.clear("a")
        left = {k async for k in r.scan_iter(match=f"{idx.prefix}:*")}
        assert {k for k in left if b":b:" in k or b":r:" in k} == {
            k for k in baseline if b":b:" in k or b":r:" in k
        }
        assert (await idx.stats())["dead_columns"] == 0
        assert await idx.lookup(H[:3]) == {"keep": {G0: 0b111}}
    finally:
        await idx.close()


async def test_redis_instance_without_heartbeat_is_hidden_then_reaped(redis_server):
    ns = new_namespace()
    idx = RedisIndex(redis_server.url, namespace=ns, instance_ttl_s=0.3)
    try:
        await idx.apply("a", batch(stored(H[:2])))
        await idx.apply("b", batch(stored(H[:2])))
        await asyncio.sleep(0.2)
        await idx.touch("b")
        await asyncio.sleep(0.2)
        assert set(await idx.lookup(H[:2])) == {"b"}
        assert await idx.instances() == ["b"]
        assert await idx.reap() == ["a"]
        await idx._reclaim_all()
        assert (await idx.stats())["entries"] == 2  # only b's
    finally:
        await idx.close()


async def test_redis_block_ttl_expires_blocks_when_enabled(redis_server):
    idx = RedisIndex(redis_server.url, namespace=new_namespace(), block_ttl_s=0.2)
    try:
        await idx.apply("a", batch(stored(H[:2])))
        assert (await idx.lookup(H[:2]))["a"] == {G0: 0b11}
        await asyncio.sleep(0.35)
        assert await idx.lookup(H[:2]) == {}
        await idx.clear("a")  # stale reverse entries of expired blocks are harmless
    finally:
        await idx.close()


async def test_redis_unix_socket_url_and_two_processes_share_one_index(redis_server):
    ns = new_namespace()
    writer = open_index(redis_server.url, namespace=ns)
    reader = open_index(redis_server.unix_url, namespace=ns)
    try:
        await writer.apply("a", batch(stored(H[:3])), seq=0)
        assert (await reader.lookup(H[:3]))["a"] == {G0: 0b111}
        await writer.apply("a", batch(removed(H[1:2])), seq=1)
        assert (await reader.lookup(H[:3]))["a"] == {G0: 0b101}
        assert await reader.cursor("a") == (1.0, 1)
    finally:
        await writer.close()
        await reader.close()
    plain = aioredis.from_url(redis_server.url)
    assert await plain.ping()
    await plain.aclose()


def _block_ops(reg: CollectorRegistry) -> dict[str, float]:
    return {
        op: reg.get_sample_value("kvroute_index_block_ops_total", {"op": op}) or 0.0
        for op in ("stored", "removed", "unknown_removed")
    }


async def test_instrumented_index_counts_blocks_and_times_calls(index):
    reg = CollectorRegistry()
    idx = InstrumentedIndex(index, IndexMetrics(reg))
    await idx.apply("a", batch(stored(H[:3]), removed(H[:1]), removed([H[9]])))
    assert (await idx.lookup(H[:3]))["a"] == {G0: 0b110}
    await idx.clear("a")
    assert _block_ops(reg) == {"stored": 3, "removed": 1, "unknown_removed": 1}
    assert reg.get_sample_value("kvroute_index_apply_seconds_count") == 1
    assert reg.get_sample_value("kvroute_index_lookup_seconds_count") == 1
    assert await idx.instances() == []


async def test_instrumented_index_counts_pipelined_batches_one_by_one(index):
    reg = CollectorRegistry()
    idx = InstrumentedIndex(index, IndexMetrics(reg))
    items = [(batch(stored(H[:3])), 0), (batch(removed(H[:1]), removed([H[9]])), 1)]
    results = await idx.apply_many("a", items)
    assert [r.applied for r in results] == [True, True]
    assert (await idx.lookup(H[:3]))["a"] == {G0: 0b110}
    assert _block_ops(reg) == {"stored": 3, "removed": 1, "unknown_removed": 1}
    assert reg.get_sample_value("kvroute_index_apply_seconds_count") == 2
