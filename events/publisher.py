"""ZMQ KV event publisher, wire-compatible with vLLM 0.33's ``ZmqEventPublisher``.

Live frames on a PUB socket: ``[topic, seq u64be, msgpack batch]``, ``seq`` from 0, +1 per
batch. The last ``buffer_steps`` payloads are kept for replay on a ROUTER socket: a request
``[id, b"", start u64be]`` is answered with ``[id, b"", topic, seq, payload]`` per buffered
batch with ``seq >= start``, then the end marker ``[id, b"", b"", 0xff*8, b""]``.

Threading: ``publish()`` may be called from any thread; it only enqueues. One daemon thread
owns both sockets (ZMQ sockets are not thread-safe). It sleeps in a ``zmq.Poller`` on the
ROUTER and a wake-up pipe written by ``publish()``, so replays are answered at once even
when idle and live batches go out without a polling delay.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

import zmq

from events.codec import encode_batch
from events.config import KVEventsConfig
from events.structs import KVEventBatch

__all__ = [
    "END_SEQ",
    "EventPublisher",
    "KVEventsConfig",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "create_publisher",
    "is_bind_endpoint",
    "offset_endpoint_port",
    "register_publisher",
]

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8  # (-1).to_bytes(8, "big", signed=True): end of a replay stream

_DRAIN_CHUNK = 256  # batches sent between two looks at the ROUTER under load
_IDLE_POLL_MS = 1000  # safety net only; wake-ups come from the pipe


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6-any and ipc/inproc endpoints bind; the rest connect
    (so many engines can push into one collector that binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Give each DP rank its own endpoint: tcp port + rank, inproc name + ``_dp{rank}``.

    Rank 0, ``None`` and tcp port 0 (OS-assigned) are returned unchanged; any other
    scheme with rank > 0 cannot be offset and raises ``ValueError``.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit() or base == "tcp":
            raise ValueError(f"tcp endpoint without a port: {endpoint!r}")
        if int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} by DP rank: use tcp:// or inproc://")


class EventPublisher:
    """Publisher API shared by the ZMQ and null implementations."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    def publish(self, batch: KVEventBatch) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def get_publisher_config(self) -> KVEventsConfig | None:
        """The resolved (DP-offset) configuration, or None when not publishing."""
        return None

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class NullEventPublisher(EventPublisher):
    """Does nothing; what an engine gets when KV events are disabled."""

    endpoint: str | None = None
    replay_endpoint: str | None = None

    def publish(self, batch: KVEventBatch) -> None:
        return None

    def shutdown(self) -> None:
        return None


class ZmqEventPublisher(EventPublisher):
    """PUB + ROUTER-replay publisher with a ring buffer of the last ``buffer_steps`` batches.

    ``endpoint`` / ``replay_endpoint`` hold the resolved addresses (DP offset applied; for a
    bound tcp port 0, the port the OS picked). ``bind=None`` follows vLLM's rule
    (:func:`is_bind_endpoint`); ``bind=True`` binds any endpoint, e.g. a loopback-only
    ``tcp://127.0.0.1:N`` that vLLM's rule would connect to.
    """

    SHUTDOWN_TIMEOUT: float = 1.0
    PUB_CLOSE_LINGER_MS: int = 200  # lets drained batches leave; close() never blocks

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        *,
        form: Literal["map", "array"] = "map",
        bind: bool | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        super().__init__(data_parallel_rank)
        if form not in ("map", "array"):
            raise ValueError(f"unknown event form {form!r}; expected 'map' or 'array'")
        self.form = form
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.max_queue_size = max_queue_size
        self._topic_bytes = topic.encode("utf-8")
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = itertools.count()
        self._closed = False
        self._stopping = False
        self._abort = False
        self._idle = False  # publisher thread is (about to be) blocked in poll()
        self.published = 0  # batches handed to the PUB socket (written by the thread only)

        resolved = offset_endpoint_port(endpoint, data_parallel_rank)
        resolved_replay = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        assert resolved is not None
        self._ctx = ctx if ctx is not None else zmq.Context.instance()
        self._pub: zmq.Socket = self._ctx.socket(zmq.PUB)
        self._router: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.RCVHWM, hwm)
            if is_bind_endpoint(resolved) if bind is None else bind:
                resolved = _bind(self._pub, resolved)
            else:
                self._pub.connect(resolved)
            if resolved_replay is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                # Room for a whole replay plus its marker (vLLM 0.33 uses the same bound).
                self._router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                resolved_replay = _bind(self._router, resolved_replay)
        except Exception:
            self._pub.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)
            raise
        self.endpoint: str = resolved
        self.replay_endpoint: str | None = resolved_replay

        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()  # guards _wake_w against close during a write
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="zmq-publisher", daemon=True)
        self._thread.start()
        logger.info(
            "KV event publisher dp_rank=%d on %s (replay %s, topic %r, form %s)",
            data_parallel_rank,
            self.endpoint,
            self.replay_endpoint,
            topic,
            form,
        )

    # -- caller side (any thread) ------------------------------------------------------

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch``; blocks while ``max_queue_size`` batches are waiting."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        self._queue.put(batch)
        if self._idle:  # only a sleeping thread needs the (syscall) wake-up
            self._wake()

    def shutdown(self) -> None:
        """Send what is queued (waiting up to ``SHUTDOWN_TIMEOUT``), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._wake()
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning(
                "KV event publisher: %d batches still queued after %.1fs; dropping them",
                self._queue.qsize(),
                self.SHUTDOWN_TIMEOUT,
            )
            self._abort = True
            self._wake()
            self._thread.join(self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.error("KV event publisher thread did not stop; leaking its sockets")
            return
        with self._wake_lock:
            os.close(self._wake_w)
            self._wake_w = -1
        os.close(self._wake_r)

    def get_publisher_config(self) -> KVEventsConfig:
        own = {name: getattr(self, name) for name in PUBLISHER_FIELDS}
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **own)

    @property
    def closed(self) -> bool:
        return self._closed

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return
            with contextlib.suppress(BlockingIOError):  # full pipe: a wake-up is pending
                os.write(self._wake_w, b"\0")

    # -- publisher thread (owns the sockets) -------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        busy = False
        try:
            while not self._abort:
                try:
                    busy = self._cycle(poller, busy)
                except Exception:  # keep publishing: a dead thread would block publish()
                    logger.exception("KV event publisher loop error")
                    time.sleep(0.1)
                    continue
                if self._stopping and self._queue.empty():
                    break
        finally:
            self._pub.close(linger=self.PUB_CLOSE_LINGER_MS)
            if self._router is not None:
                self._router.close(linger=0)

    def _cycle(self, poller: zmq.Poller, busy: bool) -> bool:
        """Sleep until work, serve replays, send a chunk; True if more may be queued."""
        # Announce sleep *before* the last emptiness check: a publish() that misses the
        # flag has already put its batch, which the check then sees.
        self._idle = True
        timeout = 0 if busy or not self._queue.empty() else _IDLE_POLL_MS
        ready = dict(poller.poll(timeout))
        self._idle = False
        if self._wake_r in ready:
            _drain_pipe(self._wake_r)
        if self._router is not None and self._router in ready:
            self._serve_replays()
        return self._send_queued(_DRAIN_CHUNK) == _DRAIN_CHUNK

    def _send_queued(self, limit: int) -> int:
        sent = 0
        while sent < limit and not self._abort:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                break
            sent += 1
            try:
                payload = encode_batch(batch, self.form)
            except Exception:
                # Encode before numbering: a bad batch must not leave a hole in the sequence.
                logger.exception("KV event publisher: cannot encode batch; dropped")
                continue
            seq = next(self._seq)
            self._buffer.append((seq, payload))  # buffered first: a failed send is replayable
            try:
                self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
                self.published += 1
            except zmq.ZMQError:
                logger.exception("KV event publisher: send of seq %d failed", seq)
        return sent

    def _serve_replays(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("invalid replay request (%d frames): %.200r", len(frames), frames)
                continue
            client, _, start_bytes = frames
            self._replay_to(client, int.from_bytes(start_bytes, "big"))

    def _replay_to(self, client: bytes, start: int) -> None:
        sent = 0
        router = self._router
        assert router is not None  # called for a request read from this ROUTER socket
        if self._buffer:
            # Buffered seqs are contiguous, so the start index is arithmetic.
            skip = max(0, start - self._buffer[0][0])
            for seq, payload in itertools.islice(self._buffer, skip, None):
                router.send_multipart(
                    (client, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload)
                )
                sent += 1
        router.send_multipart((client, b"", b"", END_SEQ, b""))
        logger.debug("replayed %d batches from seq %d", sent, start)


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (resolves an OS-chosen tcp port 0)."""
    sock.bind(endpoint)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint


def _drain_pipe(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


# -- factory -----------------------------------------------------------------------------

PublisherCtor = Callable[..., EventPublisher]
# The fields of ``KVEventsConfig`` a publisher is built from (its keyword arguments, after
# ``data_parallel_rank``) and reports back in ``get_publisher_config``.
PUBLISHER_FIELDS = ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic")
_REGISTRY: dict[str, PublisherCtor] = {"null": NullEventPublisher, "zmq": ZmqEventPublisher}


def register_publisher(name: str, ctor: PublisherCtor) -> None:
    """Make ``KVEventsConfig(publisher=name)`` build ``ctor(data_parallel_rank=..., **cfg)``."""
    if name in _REGISTRY:
        raise KeyError(f"publisher {name!r} already registered")
    _REGISTRY[name] = ctor


def create_publisher(
    config: KVEventsConfig | None,
    data_parallel_rank: int = 0,
    *,
    form: Literal["map", "array"] = "map",
    ctx: zmq.Context | None = None,
) -> EventPublisher:
    """vLLM's ``EventPublisherFactory.create``: a null publisher unless events are enabled."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher(data_parallel_rank)
    name = config.publisher or "zmq"
    ctor = _REGISTRY.get(name)
    if ctor is None:
        raise ValueError(f"unknown event publisher {name!r}; known: {sorted(_REGISTRY)}")
    kwargs: dict[str, Any] = {name: getattr(config, name) for name in PUBLISHER_FIELDS}
    if ctor is ZmqEventPublisher:
        return ZmqEventPublisher(data_parallel_rank, **kwargs, form=form, ctx=ctx)
    return ctor(data_parallel_rank=data_parallel_rank, **kwargs)
