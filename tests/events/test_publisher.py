"""ZmqEventPublisher: vLLM 0.33 wire behaviour over real sockets (mirrors vLLM's tests)."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from eventskit import (
    END,
    connect_sub,
    free_port,
    make_batch,
    nothing_within,
    recv,
    replay_request,
    seq_bytes,
)

import events.publisher as publisher_mod
from events.codec import decode_batch
from events.config import KVEventsConfig
from events.publisher import (
    NullEventPublisher,
    ZmqEventPublisher,
    create_publisher,
    is_bind_endpoint,
    offset_endpoint_port,
)
from events.structs import KVEventBatch


@pytest.fixture
def pub_sub(ports):
    port, rport = ports
    pub = ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
        buffer_steps=100,
    )
    sub = connect_sub(f"tcp://127.0.0.1:{port}")
    yield pub, sub, f"tcp://127.0.0.1:{rport}"
    sub.close()
    pub.shutdown()


def test_first_batch_has_seq_zero_and_round_trips(pub_sub):
    pub, sub, _ = pub_sub
    batch = make_batch(7)
    pub.publish(batch)
    topic, seq, data = recv(sub)
    assert (topic, seq) == (b"", seq_bytes(0))
    assert decode_batch(data) == batch
    assert decode_batch(data).data_parallel_rank == 0


def test_ten_batches_get_consecutive_seqs_in_order(pub_sub):
    pub, sub, _ = pub_sub
    for i in range(10):
        pub.publish(make_batch(i))
    got = [recv(sub) for _ in range(10)]
    assert [int.from_bytes(m[1], "big") for m in got] == list(range(10))
    assert [decode_batch(m[2]).ts for m in got] == [float(i) for i in range(10)]


def test_replay_from_seq_10_returns_10_to_18_with_topic_and_end_marker(ports):
    port, rport = ports
    with ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
        topic="test",
    ) as pub:
        for i in range(19):
            pub.publish(make_batch(i))
        time.sleep(0.2)
        replies = replay_request(f"tcp://127.0.0.1:{rport}", 10)
    assert replies[-1] == [b"", b"", END, b""]
    body = replies[:-1]
    assert [m[2] for m in body] == [seq_bytes(s) for s in range(10, 19)]
    assert all(m[0] == b"" and m[1] == b"test" for m in body)
    assert [decode_batch(m[3]).ts for m in body] == [float(s) for s in range(10, 19)]


def test_replay_buffer_keeps_only_last_buffer_steps_batches(pub_sub):
    pub, _, replay = pub_sub
    for i in range(110):
        pub.publish(make_batch(i))
    time.sleep(0.3)
    body = replay_request(replay, 0)[:-1]
    assert [int.from_bytes(m[2], "big") for m in body] == list(range(10, 110))


@pytest.fixture
def no_idle_polling(monkeypatch):
    """The publisher thread's idle poll times out only after a minute (set before the
    publisher starts): whatever it does while idle within a test, a wake-up did."""
    monkeypatch.setattr(publisher_mod, "_IDLE_POLL_MS", 60_000)


def _wait_idle(pub: ZmqEventPublisher) -> None:
    deadline = time.monotonic() + 5
    while not pub._idle:
        assert time.monotonic() < deadline, "publisher thread never went idle"
        time.sleep(0.005)


def test_an_idle_publisher_answers_replay_without_waiting_out_its_poll(no_idle_polling, pub_sub):
    pub, _, replay = pub_sub
    pub.publish(make_batch(0))
    # Sent (so buffered) before the first replay: a replay request the thread wakes to in
    # the same poll as the batch is served first, with what was sent until then (as vLLM's
    # publisher thread does), and the batch follows live.
    deadline = time.monotonic() + 5
    while pub.published < 1:
        assert time.monotonic() < deadline, "the batch was never sent"
        time.sleep(0.005)
    for _ in range(3):
        _wait_idle(pub)
        body = replay_request(replay, 0, timeout=10.0)[:-1]  # a poll-bound wait: 60 s
        assert [m[2] for m in body] == [seq_bytes(0)]


def test_an_idle_publisher_sends_a_live_batch_without_waiting_out_its_poll(
    no_idle_polling, pub_sub
):
    pub, sub, _ = pub_sub
    for i in range(3):
        _wait_idle(pub)
        pub.publish(make_batch(i))
        _, seq, _ = recv(sub, timeout=10.0)  # a poll-bound send would take 60 s
        assert seq == seq_bytes(i)


def test_invalid_replay_request_is_ignored_and_server_keeps_working(pub_sub, caplog):
    pub, _, replay = pub_sub
    pub.publish(make_batch(0))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    dealer.send_multipart([b"", b"not-a-seq", b"extra"])
    dealer.send_multipart([b"", b"\x00\x01"])  # seq of the wrong width
    assert nothing_within(dealer, 0.3)
    dealer.close()
    assert "invalid replay request" in caplog.text
    body = replay_request(replay, 0)[:-1]
    assert [m[2] for m in body] == [seq_bytes(0)]


def test_topic_filtering_delivers_only_matching_topic(ports):
    port, _ = ports
    port2 = free_port()
    with (
        ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}", bind=True, topic="foo") as foo,
        ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port2}", bind=True, topic="bar") as bar,
    ):
        sub = connect_sub(f"tcp://127.0.0.1:{port}", topic="foo")
        sub.connect(f"tcp://127.0.0.1:{port2}")
        time.sleep(0.3)
        bar.publish(make_batch(1))
        foo.publish(make_batch(2))
        topic, _, data = recv(sub)
        assert topic == b"foo" and decode_batch(data).ts == 2.0
        assert nothing_within(sub, 0.3)
        sub.close()


def test_dp_rank_1_offsets_both_tcp_ports_and_tags_batches(ports):
    port, rport = ports
    with ZmqEventPublisher(
        data_parallel_rank=1,
        endpoint=f"tcp://127.0.0.1:{port}",
        bind=True,
        replay_endpoint=f"tcp://127.0.0.1:{rport}",
    ) as pub:
        assert pub.endpoint == f"tcp://127.0.0.1:{port + 1}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{rport + 1}"
        sub = connect_sub(f"tcp://127.0.0.1:{port + 1}")
        pub.publish(make_batch(0))
        assert decode_batch(recv(sub)[2]).data_parallel_rank == 1
        sub.close()
        body = replay_request(f"tcp://127.0.0.1:{rport + 1}", 0)[:-1]
        assert decode_batch(body[0][3]).data_parallel_rank == 1


def test_dp_rank_1_appends_dp_suffix_to_inproc_endpoint():
    with ZmqEventPublisher(data_parallel_rank=1, endpoint="inproc://kv-test") as pub:
        assert pub.endpoint == "inproc://kv-test_dp1"
        sub = connect_sub("inproc://kv-test_dp1")
        pub.publish(make_batch(3))
        assert decode_batch(recv(sub)[2]).data_parallel_rank == 1
        sub.close()


def test_publish_keeps_an_explicit_rank_and_stamps_only_none(pub_sub):
    pub, sub, _ = pub_sub
    pub.publish(make_batch(0, rank=5))
    pub.publish(make_batch(1))
    assert decode_batch(recv(sub)[2]).data_parallel_rank == 5
    assert decode_batch(recv(sub)[2]).data_parallel_rank == 0


def test_offset_endpoint_port_rules():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("inproc://x", 1) == "inproc://x_dp1"
    assert offset_endpoint_port(None, 1) is None
    assert offset_endpoint_port("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/kv", 1)


def test_bind_connect_heuristic_follows_vllm():
    assert is_bind_endpoint("tcp://*:5557")
    assert is_bind_endpoint("tcp://[::]:5557")
    assert is_bind_endpoint("ipc:///tmp/kv")
    assert is_bind_endpoint("inproc://kv")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")
    assert not is_bind_endpoint("tcp://collector:5557")


def test_connect_mode_publisher_reaches_a_binding_subscriber(ports):
    port, _ = ports
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    with ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}") as pub:
        deadline = time.monotonic() + 5
        while sub.poll(0) == 0 and time.monotonic() < deadline:
            pub.publish(make_batch(1))  # until the subscription has propagated
            time.sleep(0.02)
        topic, _, data = recv(sub)
        assert topic == b"" and decode_batch(data).ts == 1.0
    sub.close()


def test_array_form_payload_is_legacy_positional_and_decodes(pub_sub):
    _, sub, _ = pub_sub
    port = free_port()
    with ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}", bind=True, form="array") as pub:
        sub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.3)
        pub.publish(make_batch(4))
        data = recv(sub)[2]
    ts, events, rank = msgspec.msgpack.decode(data)
    assert (ts, rank) == (4.0, 0)
    assert [e[0] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0][1:5] == [[4, 2**64 - 5], None, [0, 1, 2, 3], 2]  # positional fields
    assert decode_batch(data) == make_batch(4, rank=0)


def test_shutdown_drains_queued_batches(pub_sub):
    pub, sub, _ = pub_sub
    for i in range(500):
        pub.publish(make_batch(i))
    pub.shutdown()
    seqs = [int.from_bytes(recv(sub)[1], "big") for _ in range(500)]
    assert seqs == list(range(500))
    assert pub.published == 500


def test_unencodable_batch_is_dropped_without_a_hole_in_the_sequence(pub_sub, caplog):
    pub, sub, _ = pub_sub
    pub.publish(make_batch(0))
    pub.publish(KVEventBatch(ts=1.0, events=[object()]))  # type: ignore[list-item]
    pub.publish(make_batch(2))
    got = [recv(sub) for _ in range(2)]
    assert [(m[1], decode_batch(m[2]).ts) for m in got] == [
        (seq_bytes(0), 0.0),
        (seq_bytes(1), 2.0),
    ]
    assert "cannot encode batch" in caplog.text


def test_publish_after_shutdown_raises(ports):
    pub = ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{ports[0]}", bind=True)
    pub.shutdown()
    pub.shutdown()  # idempotent
    with pytest.raises(RuntimeError):
        pub.publish(make_batch(0))


def test_publish_from_many_threads_numbers_every_batch_once(pub_sub):
    pub, sub, _ = pub_sub

    def worker(k: int) -> None:
        for i in range(100):
            pub.publish(make_batch(k * 1000 + i))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [recv(sub) for _ in range(400)]
    assert [int.from_bytes(m[1], "big") for m in got] == list(range(400))
    assert sorted(decode_batch(m[2]).ts for m in got) == sorted(
        float(k * 1000 + i) for k in range(4) for i in range(100)
    )


def test_null_publisher_is_a_noop():
    pub = NullEventPublisher()
    pub.publish(make_batch(0))
    pub.shutdown()
    assert pub.get_publisher_config() is None
    with NullEventPublisher(1) as p:
        p.publish(make_batch(1))


def test_factory_returns_null_when_disabled_or_null():
    assert isinstance(create_publisher(None), NullEventPublisher)
    assert isinstance(create_publisher(KVEventsConfig()), NullEventPublisher)
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(create_publisher(cfg), NullEventPublisher)


def test_factory_builds_zmq_with_dp_offsets_and_leaves_config_untouched(ports):
    port, rport = ports
    cfg = KVEventsConfig.from_json(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{port}",'
        f' "replay_endpoint": "tcp://127.0.0.1:{rport}", "topic": "kv"}}'
    )
    assert cfg.publisher == "zmq"  # omitted + enabled -> zmq, as vLLM
    pub = create_publisher(cfg, data_parallel_rank=1)
    try:
        assert isinstance(pub, ZmqEventPublisher)
        resolved = pub.get_publisher_config()
        assert resolved.endpoint == f"tcp://127.0.0.1:{port + 1}"
        assert resolved.replay_endpoint == f"tcp://127.0.0.1:{rport + 1}"
        assert resolved.topic == "kv"
        assert cfg.endpoint == f"tcp://127.0.0.1:{port}"
    finally:
        pub.shutdown()


def test_factory_rejects_unknown_publisher():
    with pytest.raises(ValueError, match="kafka"):
        create_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="kafka"))


def test_config_defaults_and_json_validation_match_vllm():
    cfg = KVEventsConfig()
    assert (cfg.enable_kv_cache_events, cfg.publisher, cfg.endpoint) == (
        False,
        "null",
        "tcp://*:5557",
    )
    assert (cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == (
        None,
        10_000,
        100_000,
        100_000,
        "",
    )
    assert KVEventsConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="endpont"):
        KVEventsConfig.from_json('{"endpont": "tcp://*:1"}')
    with pytest.raises(ValueError):
        KVEventsConfig.from_json('{"buffer_steps": "many"}')
    with pytest.raises(ValueError):
        KVEventsConfig.from_json("[1]")
