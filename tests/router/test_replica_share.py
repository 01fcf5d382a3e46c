"""Replicas share predict-on-route records and in-flight load over a real private Redis
(``router.prediction.shared``): what one records the other reads, settling follows the
shared index's applied batches, a replica that stops leaves nothing behind, a message
that does not decode is counted and dropped."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from routerkit import eventually, new_namespace, positions

from router.prediction.shared import SharedPredictions, merge_residency

E1, E2 = "http://e1", "http://e2"


class _Replica:
    def __init__(self, url: str, channel: str, ttl_s: float = 5.0, **kw: object) -> None:
        self.client = aioredis.from_url(url)
        self.load: dict[str, tuple[int, int, int]] = {}
        self.peer_load: dict[str, tuple[int, int, int]] = {}
        self.applied: list[str] = []
        self.share = SharedPredictions(
            self.client,
            channel,
            ttl_s=ttl_s,
            load=lambda: dict(self.load),
            set_peer_load=self._set,
            on_applied=self.applied.append,
            **kw,  # type: ignore[arg-type]
        )

    def _set(self, sums: dict[str, tuple[int, int, int]]) -> None:
        self.peer_load = sums

    async def close(self) -> None:
        await self.share.close()
        await self.client.aclose()


async def _pair(redis_server, **kw):
    channel = f"{new_namespace()}:replicas"
    a, b = _Replica(redis_server.url, channel, **kw), _Replica(redis_server.url, channel, **kw)
    await a.share.start()
    await b.share.start()
    return a, b


async def test_a_record_reaches_the_other_replica_and_settles_at_an_applied_batch(redis_server):
    a, b = await _pair(redis_server)
    try:
        hashes = [11, 12, 13, 14]
        a.share.record(E1, 7, {0: hashes, 1: hashes[-1:]}, whole=0b01)

        async def seen():
            return b.share.residency(hashes, [E1, E2])

        res = await eventually(seen, timeout=5)
        assert set(res) == {E1}
        assert positions(res[E1][0]) == [0, 1, 2, 3]  # slot 0: group 0, GPU: the prefix
        assert positions(res[E1][2]) == [3]  # slot 2: group 1, GPU: the tail only
        assert a.share.residency(hashes, [E1]) == {}  # its own messages are not peers'
        assert b.share.staleness and max(b.share.staleness) < 1.0

        # Answered: held until a batch of E1 reaches the shared index (any replica's).
        a.share.settle(E1, 7)
        await eventually(lambda: _async(b.share.peers._settled.get(E1)), timeout=5)
        assert b.share.residency(hashes, [E1])
        a.share.applied(E1)
        await eventually(lambda: _async(b.applied == [E1]), timeout=5)
        assert b.share.residency(hashes, [E1]) == {}
    finally:
        await a.close()
        await b.close()


async def test_close_right_after_a_record_returns(redis_server):
    """A record wakes the publisher in the same tick that ``close`` cancels it: the
    cancellation must not be lost (Python 3.11's ``wait_for`` returned the event's result
    and dropped it, so ``close`` waited on a publisher that never stopped)."""
    for i in range(20):
        a = _Replica(redis_server.url, f"{new_namespace()}:replicas")
        await a.share.start()
        await asyncio.sleep(0.02)  # the publisher is parked on its wake-up event
        a.share.record(E1, i, {0: [1, 2]}, whole=1)
        closing = asyncio.ensure_future(a.close())
        done, _ = await asyncio.wait({closing}, timeout=5)  # wait; never cancel it
        assert closing in done, f"close() still waiting after a record (round {i})"


async def test_recorded_again_replaces_and_merge_ors_into_own(redis_server):
    a, b = await _pair(redis_server)
    try:
        a.share.record(E1, 1, {0: [1, 2, 3]}, whole=1)
        await eventually(lambda: _async(b.share.residency([1, 2, 3], [E1])), timeout=5)
        a.share.record(E1, 1, {0: [1]}, whole=1)  # relayout: the same request, fewer blocks

        async def replaced():
            res = b.share.residency([1, 2, 3], [E1])
            return res and positions(res[E1][0]) == [0]

        await eventually(replaced, timeout=5)
        own = {E1: {0: 0b100}, E2: {0: 0b1}}
        assert merge_residency(own, b.share.residency([1, 2, 3], [E1])) == {
            E1: {0: 0b101},
            E2: {0: 0b1},
        }
    finally:
        await a.close()
        await b.close()


async def test_load_is_summed_and_a_quiet_replica_leaves_nothing(redis_server):
    a, b = await _pair(redis_server, ttl_s=0.5, peer_timeout_s=0.4, heartbeat_s=0.05)
    c = None
    try:
        c = _Replica(redis_server.url, a.share.channel, ttl_s=0.5, peer_timeout_s=0.4)
        await c.share.start()
        a.load = {E1: (2, 300, 1)}
        c.load = {E1: (1, 100, 0), E2: (0, 0, 4)}
        await eventually(lambda: _async(b.peer_load == {E1: (3, 400, 1), E2: (0, 0, 4)}), timeout=5)
        a.load = {}
        await eventually(lambda: _async(b.peer_load == {E1: (1, 100, 0), E2: (0, 0, 4)}), 5)

        # c dies holding a record and a load: both are gone within their bounds at b.
        c.share.record(E2, 9, {0: [5, 6]}, whole=1)
        await eventually(lambda: _async(b.share.residency([5, 6], [E2])), timeout=5)
        await c.close()
        c = None
        await eventually(lambda: _async(b.peer_load == {}), timeout=5)
        await eventually(lambda: _async(b.share.residency([5, 6], [E2]) == {}), timeout=5)
        assert b.share.peer_count() == 1  # a still heartbeats
    finally:
        for r in (a, b, c):
            if r is not None:
                await r.close()


async def test_a_message_that_does_not_decode_is_counted_and_dropped(redis_server):
    a, b = await _pair(redis_server)
    try:
        await a.client.publish(b.share.channel, b"\xc1 not msgpack")
        await a.client.publish(b.share.channel, a.share._enc.encode(["x", 0.0, [["?", E1]], {}]))
        await eventually(lambda: _async(b.share.dropped == 2), timeout=5)
        a.share.record(E1, 3, {0: [8]}, whole=1)  # still working after them
        await eventually(lambda: _async(b.share.residency([8], [E1])), timeout=5)
    finally:
        await a.close()
        await b.close()


async def _async(value):
    return value
