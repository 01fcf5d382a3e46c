"""Cold starts: a router restarted while its engines keep serving rebuilds each instance from
the engine's replay buffer and says whether that view is complete (the buffer still holds
seq 0) or partial (batches before the first replayed one are gone); a replica restarted
on a Redis index that kept the instance is exact at once. Real ZMQ publishers
(``events.publisher``) and subscribers; the last test over real HTTP (``/debug/route``,
``/dashboard/state``)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from routerkit import (
    G0,
    ScriptedUpstream,
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
from router.config import RouterSettings
from router.http.app import create_app
from router.index import MemoryIndex
from router.index.redis_index import RedisIndex
from router.ingest import IngestManager
from router.state import RouterState


@pytest.fixture
def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def publish_history(pub: ZmqEventPublisher, n: int, start: int = 0) -> None:
    """Batches ``start`` .. n-1: batch i stores block 100 + i; every third also evicts an
    older block, so what is cached depends on the whole history. Returns once they are
    sent: history, not batches a subscriber joining now could still receive live."""
    want = pub.published + n - start
    for i in range(start, n):
        events = [stored([100 + i])]
        if i % 3 == 2:
            events.append(removed([100 + i - 2]))
        pub.publish(batch(*events, ts=time.time()))
    deadline = time.monotonic() + 10
    while pub.published < want:
        assert time.monotonic() < deadline, "publisher never sent its batches"
        time.sleep(0.005)


def cached_after(n: int) -> set[int]:
    held: set[int] = set()
    for i in range(n):
        held.add(100 + i)
        if i % 3 == 2:
            held.discard(100 + i - 2)
    return held


async def held_by(index, name: str, n: int) -> set[int]:
    hashes = list(range(100, 100 + n))
    mask = (await index.lookup(hashes)).get(name, {}).get(G0, 0)
    return {hashes[i] for i in range(n) if mask >> i & 1}


def feed(
    endpoints: tuple[str, str], buffer_steps: int
) -> tuple[ZmqEventPublisher, MemoryIndex, CollectorRegistry, IngestManager]:
    """A publisher on ``endpoints`` keeping ``buffer_steps`` batches for replay, and an
    ingest manager (on its own metrics registry) feeding a fresh in-memory index."""
    events, replay = endpoints
    pub = ZmqEventPublisher(
        endpoint=events, bind=True, replay_endpoint=replay, buffer_steps=buffer_steps
    )
    index = MemoryIndex()
    reg = CollectorRegistry()
    return pub, index, reg, IngestManager(index, registry=reg)


async def join_after_history(
    mgr: IngestManager, pub: ZmqEventPublisher, endpoints: tuple[str, str], n: int
) -> None:
    """Publish ``n`` batches of history, then add ``e1`` from seq 0 (what the buffer still
    holds comes by replay) and wait until it has handled the last of them."""
    publish_history(pub, n)
    await mgr.add_instance("e1", *endpoints, start_seq=0)
    await catch_up(mgr, "e1", pub, n - 1)


async def test_a_buffer_that_still_holds_seq_0_rebuilds_a_complete_view(endpoints):
    pub, index, _, mgr = feed(endpoints, buffer_steps=100)
    try:
        await join_after_history(mgr, pub, endpoints, 12)
        assert await held_by(index, "e1", 12) == cached_after(12)
        view = mgr.view("e1")
        assert view is not None
        assert (view["view"], view["origin"], view["lost_seqs"]) == ("complete", "replay", None)
    finally:
        await mgr.close()
        pub.shutdown()


async def test_a_buffer_that_lost_early_batches_gives_a_partial_view_that_never_over_predicts(
    endpoints,
):
    pub, index, reg, mgr = feed(endpoints, buffer_steps=5)
    try:
        await join_after_history(mgr, pub, endpoints, 12)  # the buffer keeps seqs 7..11
        view = mgr.view("e1")
        assert view is not None
        assert (view["view"], view["lost_seqs"]) == ("partial", [0, 6])
        held = await held_by(index, "e1", 12)
        assert held < cached_after(12)  # blocks stored before seq 7 are unknown...
        assert held == {h for h in cached_after(12) if h >= 107}  # ...the rest is exact
        # The lost range was known from the start: no second clear and replay for it.
        assert reg.get_sample_value("kvroute_ingest_resyncs_total", {"instance": "e1"}) in (
            None,
            0.0,
        )
    finally:
        await mgr.close()
        pub.shutdown()


async def test_an_engine_restart_makes_a_partial_view_complete_again(endpoints):
    old, index, _, mgr = feed(endpoints, buffer_steps=3)
    try:
        await join_after_history(mgr, old, endpoints, 8)
        assert mgr.view("e1")["view"] == "partial"
    finally:
        old.shutdown()
    new = await rebind(*endpoints)
    try:
        new.publish(batch(stored([7]), ts=time.time()))

        async def restarted() -> bool:
            view = mgr.view("e1")
            if view["view"] == "complete" and view["origin"] == "restart":
                return True
            new.publish(batch(ts=time.time()))
            await asyncio.sleep(0.05)
            return False

        await eventually(restarted)
        got = await index.lookup([*range(100, 108), 7])
        assert got["e1"] == {G0: 1 << 8}
    finally:
        await mgr.close()
        new.shutdown()


async def test_a_replica_restarted_on_a_redis_index_is_exact_at_once(redis_server, endpoints):
    """Replica A ingested from the engine's start; B (a restarted replica) joins when the
    engine's buffer no longer holds seq 0: it continues from the index's cursor, keeps the
    exact state (no clear, no lost range) and applies what follows once."""
    events, replay = endpoints
    ns = new_namespace()
    pub = ZmqEventPublisher(endpoint=events, bind=True, replay_endpoint=replay, buffer_steps=4)
    idx_a, idx_b = (RedisIndex(redis_server.url, namespace=ns) for _ in range(2))
    a = IngestManager(idx_a, registry=CollectorRegistry())
    b = IngestManager(idx_b, registry=CollectorRegistry())
    try:
        publish_history(pub, 3)
        await a.add_instance("e1", events, replay, start_seq=0)
        await catch_up(a, "e1", pub, 2)  # from replay: A has seen seq 0 on
        publish_history(pub, 12, start=3)  # live; the buffer ends up holding 8..11
        await catch_up(a, "e1", pub, 11)
        assert a.view("e1")["view"] == "complete"
        await a.close()  # replica A goes away; the shared index keeps the instance
        await b.add_instance("e1", events, replay, start_seq=0)
        view = await eventually(lambda: _decided(b, "e1"))
        assert (view["view"], view["origin"], view["lost_seqs"]) == ("complete", "index", None)
        assert await held_by(idx_b, "e1", 12) == cached_after(12)  # exact before any batch
        pub.publish(batch(stored([112]), ts=time.time()))
        await catch_up(b, "e1", pub, 12)
        assert await held_by(idx_b, "e1", 13) == cached_after(12) | {112}
        assert b.view("e1")["view"] == "complete"
    finally:
        await a.close()
        await b.close()
        pub.shutdown()
        await idx_b.clear("e1")
        await idx_a.close()
        await idx_b.close()


async def _decided(mgr: IngestManager, name: str) -> dict | None:
    view = mgr.view(name)
    return view if view is not None and view["view"] != "waiting" else None


async def test_a_kept_state_of_an_engine_that_restarted_since_is_rebuilt_not_continued(
    redis_server, endpoints
):
    """The engine restarted while no replica ran and counted past the index's cursor: its
    batch at the cursor's seq is another one (another ts), so the old state is cleared
    and the new incarnation rebuilt from replay -- never continued onto the old blocks."""
    events, replay = endpoints
    ns = new_namespace()
    idx_a, idx_b = (RedisIndex(redis_server.url, namespace=ns) for _ in range(2))
    a = IngestManager(idx_a, registry=CollectorRegistry())
    b = IngestManager(idx_b, registry=CollectorRegistry())
    old = ZmqEventPublisher(endpoint=events, bind=True, replay_endpoint=replay)
    try:
        publish_history(old, 6)
        await a.add_instance("e1", events, replay, start_seq=0)
        await catch_up(a, "e1", old, 5)
        await a.close()
        old.shutdown()
        new = await rebind(events, replay)
        try:
            for i in range(12):  # past the old cursor's seq
                new.publish(batch(stored([200 + i]), ts=time.time()))
            while new.published < 12:
                await asyncio.sleep(0.005)
            await b.add_instance("e1", events, replay, start_seq=0)
            await catch_up(b, "e1", new, 11)
            view = b.view("e1")
            assert (view["view"], view["origin"]) == ("complete", "replay")
            assert await held_by(idx_b, "e1", 12) == set()  # the old blocks are gone
            hashes = list(range(200, 212))
            assert (await idx_b.lookup(hashes))["e1"] == {G0: (1 << 12) - 1}
        finally:
            new.shutdown()
    finally:
        await a.close()
        await b.close()
        await idx_b.clear("e1")
        await idx_a.close()
        await idx_b.close()


class Engine(ScriptedUpstream):
    """An engine's HTTP face for the router's probes (``/health`` and the rest: ``200 {}``)."""


async def test_router_restarted_says_per_instance_which_view_is_partial(endpoints):
    """Two engines keep serving while the router restarts: the one whose replay buffer no
    longer reaches seq 0 is ``partial`` in ``/debug/route`` and on the dashboard, the other
    ``complete``."""
    ev_a, rp_a = endpoints
    ev_b, rp_b = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub_a = ZmqEventPublisher(endpoint=ev_a, bind=True, replay_endpoint=rp_a, buffer_steps=4)
    pub_b = ZmqEventPublisher(endpoint=ev_b, bind=True, replay_endpoint=rp_b, buffer_steps=100)
    publish_history(pub_a, 10)
    publish_history(pub_b, 10)
    async with Engine() as eng_a, Engine() as eng_b:
        settings = RouterSettings(
            instances=[f"{eng_a.url}={ev_a},replay={rp_a}", f"{eng_b.url}={ev_b},replay={rp_b}"],
            engine_metrics=False,
        )
        state = RouterState(settings)
        await state.start()
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
            )
        )
        serving = asyncio.create_task(server.serve())
        try:
            await catch_up(state.ingest, eng_a.url, pub_a, 9)
            await catch_up(state.ingest, eng_b.url, pub_b, 9)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                await eventually(lambda: _up(client))
                r = await client.post("/debug/route", json={"prompt": "hello there, engines"})
                assert r.status_code == 200, r.text
                views = {c["instance"]: c["view"] for c in r.json()["candidates"]}
                assert views[eng_a.url]["view"] == "partial"
                assert views[eng_a.url]["lost_seqs"] == [0, 5]
                assert views[eng_b.url]["view"] == "complete"
                snap = (await client.get("/dashboard/state")).json()
                dash = {i["url"]: i["ingest"]["view"]["view"] for i in snap["instances"]}
                assert dash == {eng_a.url: "partial", eng_b.url: "complete"}
        finally:
            server.should_exit = True
            await serving
            await state.stop()
            pub_a.shutdown()
            pub_b.shutdown()


async def _up(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/health")).status_code == 200
    except httpx.HTTPError:
        return False
