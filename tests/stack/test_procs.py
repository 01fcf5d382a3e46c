"""``stack.procs.ipc_endpoint``: one name, one path for the life of the process, so a
publisher restarted on it rebinds where its subscribers reconnect (real ZMQ sockets)."""

from __future__ import annotations

import time

import zmq

from stack.procs import ipc_endpoint


def _received(pub: zmq.Socket, sub: zmq.Socket, payload: bytes, timeout_s: float = 10.0) -> bool:
    """Publish ``payload`` until ``sub`` receives it (a SUB joins a PUB asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.send(payload)
        if sub.poll(50):
            return sub.recv() == payload
    return False


def test_same_name_same_path_and_a_restarted_publisher_is_found_again():
    a, b = ipc_endpoint("procs-test"), ipc_endpoint("procs-test")
    assert a == b and a.startswith("ipc://")
    assert ipc_endpoint("procs-other") != a
    assert len(a.removeprefix("ipc://").encode()) < 107  # the longest ipc path ZMQ takes
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RECONNECT_IVL, 20)
    try:
        pub = ctx.socket(zmq.PUB)
        pub.bind(a)
        sub.connect(a)
        assert _received(pub, sub, b"first")
        pub.close(linger=0)  # the engine goes away ...
        pub = ctx.socket(zmq.PUB)  # ... and comes back, asking for its endpoint again
        pub.bind(ipc_endpoint("procs-test"))
        assert _received(pub, sub, b"second")
        pub.close(linger=0)
    finally:
        sub.close(linger=0)
        ctx.term()
