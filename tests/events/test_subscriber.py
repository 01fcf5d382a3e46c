"""ZmqEventSubscriber: ordering, gap healing, restarts and bad input over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq
from eventskit import (
    FakeReplayServer,
    RawPub,
    free_port,
    make_batch,
    next_item,
    payload,
    seq_bytes,
    warm_up,
)

from events.publisher import ZmqEventPublisher
from events.subscriber import (
    BatchesMissed,
    BatchReceived,
    SourceRestarted,
    ZmqEventSubscriber,
)


def summary(items):
    """Compact view: (kind, seq-ish, replayed) per item."""
    out = []
    for it in items:
        if isinstance(it, BatchReceived):
            out.append(("batch", it.seq, it.replayed))
        elif isinstance(it, BatchesMissed):
            out.append(("missed", it.first_seq, it.last_seq))
        else:
            out.append(("restarted", it.last_seq, it.new_seq))
    return out


async def take(sub, n, timeout=5.0):
    return [await next_item(sub, timeout) for _ in range(n)]


@pytest.fixture
async def raw(ports):
    """A raw PUB, a fake replay ROUTER and a subscriber on both, synced on seq 0."""
    port, rport = ports
    pub = RawPub(port)
    server = FakeReplayServer(rport)
    sub = ZmqEventSubscriber(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", replay_timeout=0.5, name="t"
    )
    await sub.start()
    first = await warm_up(pub, sub, 0, payload(0))
    assert summary([first]) == [("batch", 0, False)]
    yield pub, server, sub
    await sub.close()
    await server.close()
    pub.close()


async def test_live_batches_are_delivered_in_sequence_and_duplicates_dropped(raw):
    pub, _, sub = raw
    for seq in range(1, 6):
        pub.send(seq, payload(seq))
        pub.send(seq, payload(seq))  # an identical resend is a duplicate, not a restart
    items = await take(sub, 5)
    assert summary(items) == [("batch", s, False) for s in range(1, 6)]
    assert [it.batch.ts for it in items] == [float(s) for s in range(1, 6)]
    assert sub.stats.last_seq == 5 and sub.stats.received == 6
    assert sub.stats.gaps == sub.stats.restarts == 0


async def test_gap_is_healed_by_replay_and_delivered_in_order(raw):
    pub, server, sub = raw
    server.store = {s: payload(s) for s in range(0, 7)}
    for seq in (1, 2, 6, 7):  # 3..5 lost on the way
        pub.send(seq, payload(seq))
    items = await take(sub, 6)
    assert summary(items) == [
        ("batch", 1, False),
        ("batch", 2, False),
        ("batch", 3, True),
        ("batch", 4, True),
        ("batch", 5, True),
        ("batch", 6, False),
    ]
    assert [it.batch.ts for it in items] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert server.requests == [2]  # from last_seq: the anchor batch proves continuity
    assert (sub.stats.gaps, sub.stats.replayed, sub.stats.missed) == (1, 3, 0)
    assert summary([await next_item(sub)]) == [("batch", 7, False)]


async def test_gap_beyond_replay_buffer_yields_missed_prefix_then_replayed(raw):
    pub, server, sub = raw
    server.store = {s: payload(s) for s in range(4, 9)}  # publisher buffer starts at 4
    pub.send(8, payload(8))
    items = await take(sub, 5)
    assert summary(items) == [
        ("missed", 1, 3),
        ("batch", 4, True),
        ("batch", 5, True),
        ("batch", 6, True),
        ("batch", 7, True),
    ]
    assert summary([await next_item(sub)]) == [("batch", 8, False)]
    assert sub.stats.missed == 3


async def test_replay_in_legacy_form_without_topic_is_understood(raw):
    pub, server, sub = raw
    server.with_topic = False
    server.store = {s: payload(s) for s in range(0, 4)}
    pub.send(3, payload(3))
    assert summary(await take(sub, 3)) == [
        ("batch", 1, True),
        ("batch", 2, True),
        ("batch", 3, False),
    ]


async def test_replay_timeout_reports_batches_missed_and_stream_goes_on(raw):
    pub, server, sub = raw
    server.silent = True
    pub.send(4, payload(4))
    items = await take(sub, 2)
    assert summary(items) == [("missed", 1, 3), ("batch", 4, False)]
    server.silent = False
    server.store = {s: payload(s) for s in range(0, 8)}
    pub.send(7, payload(7))  # the replacement DEALER still works
    assert summary(await take(sub, 3)) == [
        ("batch", 5, True),
        ("batch", 6, True),
        ("batch", 7, False),
    ]


async def test_gap_without_replay_endpoint_yields_batches_missed(ports):
    port, _ = ports
    pub = RawPub(port)
    async with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}") as sub:
        await warm_up(pub, sub, 10, payload(10))
        pub.send(14, payload(14))
        items = await take(sub, 2)
        assert summary(items) == [("missed", 11, 13), ("batch", 14, False)]
        assert (sub.stats.gaps, sub.stats.missed) == (1, 3)
    pub.close()


async def test_late_joiner_takes_first_seq_as_baseline_not_gap(raw):
    pub, _, sub = raw  # raw synced on seq 0; a second subscriber joins at seq 50
    port = int(sub.endpoint.rsplit(":", 1)[1])
    async with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}") as late:
        first = await warm_up(pub, late, 50, payload(50))
        pub.send(51, payload(51))
        assert summary([first, await next_item(late)]) == [
            ("batch", 50, False),
            ("batch", 51, False),
        ]
        assert late.stats.gaps == late.stats.missed == 0


async def test_sequence_back_to_zero_is_a_restart(raw):
    pub, server, sub = raw
    for seq in range(1, 4):
        pub.send(seq, payload(seq))
    pub.send(0, payload(0, epoch=1))
    items = await take(sub, 5)
    assert summary(items)[3:] == [("restarted", 3, 0), ("batch", 0, False)]
    assert items[4].batch.ts == 1_000_000.0
    assert server.requests == []  # nothing before 0 to recover
    assert sub.stats.restarts == 1


@pytest.mark.parametrize(
    "seen, restarted_at",
    [
        (5, 2),  # the new incarnation is behind us: its seq goes backwards
        (3, 8),  # it already counted past us: seq 8 looks like an ordinary gap (the anchor)
    ],
)
async def test_a_restarted_publisher_is_replayed_from_zero(raw, seen, restarted_at):
    pub, server, sub = raw
    for seq in range(1, seen + 1):
        pub.send(seq, payload(seq))
    await take(sub, seen)
    server.store = {s: payload(s, epoch=1) for s in range(0, restarted_at + 1)}
    pub.send(restarted_at, payload(restarted_at, epoch=1))
    items = await take(sub, restarted_at + 2)
    assert summary(items) == [
        ("restarted", seen, restarted_at),
        *[("batch", s, True) for s in range(restarted_at)],
        ("batch", restarted_at, False),
    ]
    assert [it.batch.ts for it in items[1:]] == [1_000_000.0 + s for s in range(restarted_at + 1)]


async def test_undecodable_payload_is_counted_skipped_and_not_a_gap(raw):
    pub, _, sub = raw
    pub.send(1, b"\xc1garbage")
    pub.send(2, payload(2))
    assert summary([await next_item(sub)]) == [("batch", 2, False)]
    assert sub.stats.undecodable == 1 and sub.stats.gaps == 0


async def test_malformed_frames_are_counted_and_skipped(raw):
    pub, _, sub = raw
    pub.send_frames([b"", seq_bytes(1)])  # no payload frame
    pub.send_frames([b"", b"\x01\x02", payload(1)])  # seq not 8 bytes
    pub.send_frames([b"", seq_bytes(1), payload(1), b"extra"])
    pub.send(1, payload(1))
    assert summary([await next_item(sub)]) == [("batch", 1, False)]
    assert sub.stats.undecodable == 3


async def test_start_seq_resumes_from_replay_then_follows_live_without_duplicates(ports):
    port, rport = ports
    with ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
        buffer_steps=100,
    ) as pub:
        for i in range(20):
            pub.publish(make_batch(i))
        await asyncio.sleep(0.2)
        async with ZmqEventSubscriber(
            f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", start_seq=5
        ) as sub:
            items = await take(sub, 15)
            assert summary(items) == [("batch", s, True) for s in range(5, 20)]
            got = []
            n = 20
            while len(got) < 10:  # keep publishing: live may join late, gaps heal by replay
                pub.publish(make_batch(n))
                n += 1
                await asyncio.sleep(0.01)
                while len(got) < 10:
                    try:
                        got.append(await next_item(sub, 0.05))
                    except TimeoutError:
                        break
            assert [it.seq for it in got] == list(range(20, 30))
            assert all(isinstance(it, BatchReceived) for it in got)


async def test_live_copies_of_batches_the_resume_replay_delivered_are_not_a_restart(ports):
    port, rport = ports
    pub = RawPub(port)
    server = FakeReplayServer(rport)
    server.store = {s: payload(s) for s in range(6)}
    async with ZmqEventSubscriber(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", start_seq=0
    ) as sub:
        await pub.wait_subscribed()
        for seq in (4, 5, 6):  # 4 and 5 overlap what the replay already delivered
            pub.send(seq, payload(seq))
        items = await take(sub, 7)
        assert summary(items) == [*[("batch", s, True) for s in range(6)], ("batch", 6, False)]
        assert sub.stats.restarts == 0
    await server.close()
    pub.close()


async def test_start_seq_without_replay_reports_the_unrecoverable_prefix(ports):
    port, _ = ports
    pub = RawPub(port)
    async with ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", start_seq=0) as sub:
        first = await warm_up(pub, sub, 3, payload(3))
        assert summary([first, await next_item(sub)]) == [
            ("missed", 0, 2),
            ("batch", 3, False),
        ]
    pub.close()


async def rebind(kwargs: dict) -> ZmqEventPublisher:
    """A publisher on the ports one just shut down: bound once the old sockets let go."""
    deadline = time.monotonic() + 10.0
    while True:
        try:
            return ZmqEventPublisher(**kwargs)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_publisher_restart_on_same_port_yields_source_restarted_before_new_batches(ports):
    port, rport = ports
    kwargs = {
        "endpoint": f"tcp://127.0.0.1:{port}",
        "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{rport}",
    }

    async def publish_until(pub, sub, want):
        items, n = [], 0
        while len(items) < want:
            pub.publish(make_batch(n, ts=float(pub.data_parallel_rank * 1000 + n)))
            n += 1
            await asyncio.sleep(0.02)
            while len(items) < want:
                try:
                    items.append(await next_item(sub, 0.01))
                except TimeoutError:
                    break
        return items, n

    async with ZmqEventSubscriber(
        f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", replay_timeout=1.0
    ) as sub:
        old = ZmqEventPublisher(**kwargs)
        # A restart shows as the sequence going back. The new incarnation's first batches
        # are lost while the SUB reconnects (PUB drops what no peer takes), so the old one
        # must have counted past what that can lose: with 5 the new one's seq 5 arrived
        # first once and read as the old one's next batch.
        before, sent = await publish_until(old, sub, 40)
        old.shutdown()
        # Batches of the old incarnation still in flight: until its last one is in (on a
        # loaded machine one straggled past a fixed 0.3 s wait), or none comes for 2 s.
        while before[-1].seq < sent - 1:
            try:
                before.append(await next_item(sub, 2.0))
            except TimeoutError:
                break
        new = await rebind(kwargs)  # same ports, counter back at 0
        new.data_parallel_rank = 7  # distinguishes its batches' ts
        try:
            after, _ = await publish_until(new, sub, 3)
        finally:
            new.shutdown()
    assert all(isinstance(it, BatchReceived) for it in before)
    last_old = before[-1].seq
    assert isinstance(after[0], SourceRestarted) and after[0].last_seq == last_old
    assert [it.seq for it in after[1:]] == [0, 1]  # new incarnation from its first batch
    assert all(it.batch.ts >= 7000 for it in after[1:])
    assert sub.stats.restarts == 1 and sub.stats.reconnects >= 1


async def test_close_ends_a_pending_iteration_cleanly(ports):
    port, _ = ports
    sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{port}")
    await sub.start()

    async def consume():
        return [item async for item in sub]

    task = asyncio.get_running_loop().create_task(consume())
    await asyncio.sleep(0.1)
    await sub.close()
    assert await asyncio.wait_for(task, 2) == []


async def test_caller_timeout_mid_replay_neither_loses_nor_repeats_the_healing(raw):
    pub, server, sub = raw
    server.delay = 0.3  # slower than the caller's patience, within replay_timeout
    server.store = {s: payload(s) for s in range(0, 4)}
    pub.send(3, payload(3))
    with pytest.raises(TimeoutError):
        await next_item(sub, 0.1)  # caller gives up while the replay is in flight
    assert summary(await take(sub, 3)) == [
        ("batch", 1, True),
        ("batch", 2, True),
        ("batch", 3, False),
    ]
    assert server.requests == [0] and sub.stats.gaps == 1


async def test_high_volume_stream_arrives_complete_and_in_order(ports):
    port, rport = ports
    n = 3000
    with ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
        buffer_steps=n,
    ) as pub:
        async with ZmqEventSubscriber(
            f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", start_seq=0
        ) as sub:
            for i in range(n):
                pub.publish(make_batch(i))
            items = await take(sub, n, timeout=10)
    assert [it.seq for it in items] == list(range(n))
    assert all(isinstance(it, BatchReceived) and it.batch.ts == it.seq for it in items)
    assert sub.stats.missed == sub.stats.restarts == 0


async def test_publisher_on_os_chosen_port_reports_the_bound_endpoint():
    with ZmqEventPublisher(
        endpoint="tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0"
    ) as pub:
        port = int(pub.endpoint.rsplit(":", 1)[1])
        rport = int(pub.replay_endpoint.rsplit(":", 1)[1])
        assert port > 0 and rport > 0 and port != rport
        pub.publish(make_batch(0))
        await asyncio.sleep(0.1)
        async with ZmqEventSubscriber(
            f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", start_seq=0
        ) as sub:
            assert summary([await next_item(sub)]) == [("batch", 0, True)]


async def test_subscriber_reaches_an_in_process_publisher_over_inproc():
    with ZmqEventPublisher(data_parallel_rank=1, endpoint="inproc://kv-sub-test") as pub:
        async with ZmqEventSubscriber("inproc://kv-sub-test_dp1") as sub:
            items, n = [], 0
            while not items:  # publish until the subscription has landed
                pub.publish(make_batch(n))
                n += 1
                with contextlib.suppress(TimeoutError):
                    items.append(await next_item(sub, 0.02))
    assert items[0].batch.data_parallel_rank == 1


def test_free_port_helper_returns_bindable_consecutive_ports():
    import socket

    base = free_port(2)
    for p in (base, base + 1):
        with socket.socket() as s:
            s.bind(("", p))
