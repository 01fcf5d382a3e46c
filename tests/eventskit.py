"""Helpers for transport tests: free ports, raw PUB/ROUTER stand-ins, sync receivers.

Everything runs over real ZMQ sockets on 127.0.0.1 with bounded waits. A plain module on
the test path (pyproject: ``pythonpath = ["tests"]``), imported as ``eventskit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from events.codec import encode_batch
from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END = b"\xff" * 8


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A port with ``span`` consecutive free ports from it (DP offsets need port+rank)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + span <= 65535 and all(_port_free(base + i) for i in range(1, span)):
            return base
    raise RuntimeError("no free port range found")


def make_batch(i: int, *, ts: float | None = None, rank: int | None = None) -> KVEventBatch:
    """A batch whose content identifies ``i`` (block hash i, ts i unless given)."""
    return KVEventBatch(
        ts=float(i) if ts is None else ts,
        events=[
            BlockStored(
                block_hashes=[i, 2**64 - 1 - i],
                parent_block_hash=None,
                token_ids=list(range(4)),
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=rank,
    )


def payload(i: int, *, epoch: int = 0) -> bytes:
    """Encoded batch ``i`` of publisher incarnation ``epoch`` (differs per epoch)."""
    return encode_batch(make_batch(i, ts=float(epoch * 1_000_000 + i), rank=0))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


# -- sync receivers (publisher tests) --------------------------------------------------


def connect_sub(endpoint: str, topic: str = "", ctx: zmq.Context | None = None) -> zmq.Socket:
    """A SUB connected to ``endpoint`` whose subscription has very likely reached the PUB:
    waits for the handshake, then a short grace period (the slow-joiner window)."""
    ctx = ctx or zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    if endpoint.startswith("tcp://"):
        if not mon.poll(5000):
            raise TimeoutError(f"no handshake with {endpoint}")
        recv_monitor_message(mon)
    sub.disable_monitor()
    mon.close(linger=0)
    time.sleep(0.1)
    return sub


def recv(sock: zmq.Socket, timeout: float = 3.0) -> list[bytes]:
    """One multipart message or TimeoutError (never hangs a test)."""
    if not sock.poll(int(timeout * 1000)):
        raise TimeoutError("nothing received")
    return sock.recv_multipart()


def nothing_within(sock: zmq.Socket, timeout: float) -> bool:
    return not sock.poll(int(timeout * 1000))


def replay_request(endpoint: str, start: int, timeout: float = 3.0) -> list[list[bytes]]:
    """Ask a ROUTER for a replay from ``start`` over a DEALER; all replies incl. the marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", seq_bytes(start)])
        replies = []
        while True:
            frames = recv(dealer, timeout)
            replies.append(frames)
            if frames[-2] == END:
                return replies
    finally:
        dealer.close()


# -- raw publisher stand-ins (subscriber tests) ----------------------------------------


class RawPub:
    """A bare publisher to send frames with chosen seqs, payloads and shapes. It is an
    XPUB, so a test can wait until a subscription has actually arrived."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")

    async def wait_subscribed(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.sock.poll(0):
            if time.monotonic() > deadline:
                raise TimeoutError("no subscription arrived")
            await asyncio.sleep(0.01)
        assert self.sock.recv()[:1] == b"\x01"

    def send(self, seq: int, data: bytes, topic: bytes = b"") -> None:
        self.sock.send_multipart([topic, seq_bytes(seq), data])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


class FakeReplayServer:
    """A ROUTER answering vLLM replay requests from ``store`` (seq -> payload)."""

    def __init__(self, port: int, *, silent: bool = False, with_topic: bool = True) -> None:
        self.store: dict[int, bytes] = {}
        self.requests: list[int] = []
        self.silent = silent
        self.delay = 0.0  # seconds before answering
        self.with_topic = with_topic
        self.sock = zmq.asyncio.Context(zmq.Context.instance()).socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, _, start = await self.sock.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if self.silent:
                continue
            await asyncio.sleep(self.delay)
            head = [ident, b"", b""] if self.with_topic else [ident, b""]
            for seq in sorted(self.store):
                if seq >= int.from_bytes(start, "big"):
                    await self.sock.send_multipart([*head, seq_bytes(seq), self.store[seq]])
            await self.sock.send_multipart([*head, END, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close(linger=0)


async def next_item(sub: AsyncIterator, timeout: float = 5.0):
    return await asyncio.wait_for(anext(sub), timeout)


async def warm_up(pub: RawPub, sub: AsyncIterator, seq: int, data: bytes):
    """Resend ``seq`` until the subscriber yields it (beats the slow joiner); the extra
    byte-identical copies must be dropped as duplicates."""

    async def spam() -> None:
        while True:
            pub.send(seq, data)
            await asyncio.sleep(0.02)

    task = asyncio.get_running_loop().create_task(spam())
    try:
        return await next_item(sub)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
