"""Asyncio KV event subscriber: SUB for live batches, DEALER for vLLM's replay protocol.

One subscriber follows one publisher. Iteration yields, strictly in seq order,
``BatchReceived`` / ``SourceRestarted`` / ``BatchesMissed``. The rules (see TRANSPORT.md):

* The first seq seen is a baseline, not a gap (late joiner) -- unless ``start_seq`` was
  given: ``start()`` then replays from it, and what replay cannot supply is missed.
* Gap (``seq > last + 1``): replay from ``last`` -- the *anchor*: if the publisher's copy of
  ``last`` differs from the bytes we saw, it restarted and counted past us (see below).
  Replayed batches come out with ``replayed=True``, sub-ranges replay cannot supply (evicted,
  no replay endpoint, timeout) as ``BatchesMissed``, then the live batch. Live batches that
  arrive meanwhile wait in the SUB socket, so nothing is reordered.
* ``seq <= last``: a duplicate (dropped) if byte-identical to what we delivered for that seq
  (happens when a ``start_seq`` replay overtook the live stream); otherwise the publisher
  restarted (vLLM has no epoch): ``SourceRestarted(last, seq)``, the consumer must drop this
  source's state; then the new incarnation's ``0 .. seq-1`` as for a gap, then the batch.
* Bad input never raises: undecodable payloads are counted and skipped, their seq counts
  as seen; frames of the wrong shape are counted as undecodable and dropped.

``stats``: ``received`` / ``replayed`` batches delivered live / from replay, ``missed`` seqs
never recovered, ``undecodable``, ``gaps``, ``restarts``, ``reconnects`` (socket monitor).

Payloads wait undecoded (wire bytes) until iteration reaches them: a replay delivers a
publisher's whole buffer at once, and decoded it would be many times its size.
``token_ids=False`` decodes for routing (``events.codec.decode_batch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from events.codec import decode_batch
from events.publisher import END_SEQ
from events.structs import KVEventBatch

__all__ = [
    "BatchReceived",
    "BatchesMissed",
    "SourceRestarted",
    "SubscriberItem",
    "SubscriberStats",
    "ZmqEventSubscriber",
]

logger = logging.getLogger(__name__)

_SUB_RCVHWM = 100_000  # as deep as the publisher's default PUB hwm
# Sockets one context may hold. libzmq's default, 1023, is four per subscriber (SUB,
# DEALER and the monitor's pair) short of a 256-instance fleet: the 256th subscriber
# failed with EMFILE. Raised on the shared context before its first socket (libzmq sizes
# its table then); file descriptors stay bounded by the process's own limit.
_MAX_SOCKETS = 65_536


def _shared_context() -> zmq.Context[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    with contextlib.suppress(zmq.ZMQError):
        want = min(_MAX_SOCKETS, ctx.get(zmq.SOCKET_LIMIT))
        if ctx.get(zmq.MAX_SOCKETS) < want:
            ctx.set(zmq.MAX_SOCKETS, want)
    return ctx


@dataclass(frozen=True, slots=True)
class BatchReceived:
    """A decoded batch, in sequence order."""

    seq: int
    batch: KVEventBatch
    replayed: bool


@dataclass(frozen=True, slots=True)
class SourceRestarted:
    """The sequence went backwards: the publisher restarted; drop this source's state."""

    last_seq: int
    new_seq: int


@dataclass(frozen=True, slots=True)
class BatchesMissed:
    """``[first_seq, last_seq]`` could not be recovered; state derived from them is stale."""

    first_seq: int
    last_seq: int


SubscriberItem = BatchReceived | SourceRestarted | BatchesMissed


@dataclass(frozen=True, slots=True)
class _Undecoded:
    """A ``BatchReceived`` still in wire form, decoded when iteration reaches it."""

    seq: int
    payload: bytes
    replayed: bool


@dataclass
class SubscriberStats:
    received: int = 0
    replayed: int = 0
    missed: int = 0
    undecodable: int = 0
    gaps: int = 0
    restarts: int = 0
    reconnects: int = 0
    last_seq: int | None = None


class ZmqEventSubscriber:
    """Follow one publisher's KV event stream, healing gaps through its replay endpoint.

    ``bind=None`` binds the SUB only for a wildcard endpoint (``tcp://*:N``), i.e. when
    connect-mode publishers push into us; the replay DEALER always connects.
    ``replay_timeout`` bounds the wait for each replay reply message, in seconds.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        start_seq: int | None = None,
        bind: bool | None = None,
        replay_timeout: float = 2.0,
        ctx: zmq.asyncio.Context | None = None,
        name: str = "",
        token_ids: bool = True,
    ) -> None:
        if start_seq is not None and start_seq < 0:
            raise ValueError("start_seq must be >= 0")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.start_seq = start_seq
        self.bind = ("*" in endpoint) if bind is None else bind
        self.replay_timeout = replay_timeout
        self.name = name or endpoint
        self.token_ids = token_ids
        self.stats = SubscriberStats()
        # Shadow the process-wide sync context so inproc:// reaches an in-process publisher.
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context(_shared_context())
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._pending: deque[SubscriberItem | _Undecoded] = deque()
        self._last_seq: int | None = None
        self._last_payload: bytes | None = None  # bytes of _last_seq, for anchor checks
        self._ahead: dict[int, int] = {}  # seq -> hash(payload) replayed before SUB saw it
        self._ahead_max = -1
        self._step: asyncio.Task[None] | None = None  # receive + process one live message
        self._started = False
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect; with ``start_seq`` and a replay endpoint, replay from it first."""
        if self._started:
            return
        if self._closed:
            raise RuntimeError("subscriber is closed")
        self._started = True
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, _SUB_RCVHWM)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED
            | zmq.EVENT_ACCEPTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_MONITOR_STOPPED
        )
        self._monitor_task = asyncio.get_running_loop().create_task(self._watch(monitor))
        self._sub = sub
        if self.bind:
            await self._bind(sub)
        else:
            sub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._dealer = self._new_dealer()
        logger.info(
            "%s: subscribed (topic %r, replay %s)", self.name, self.topic, self.replay_endpoint
        )
        if self.start_seq is not None:
            # SUB is already connected, so live batches published during the replay queue
            # up there and are deduplicated against what the replay delivered.
            await self._resume(self.start_seq)

    async def _bind(self, sub: zmq.asyncio.Socket, attempts: int = 40) -> None:
        """Bind, waiting (bounded) for a socket of ours that had the endpoint -- a
        subscriber closed for a resync -- to let go of it: libzmq's I/O thread releases
        a closed listener asynchronously."""
        for attempt in range(attempts):
            try:
                sub.bind(self.endpoint)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.025)

    async def close(self) -> None:
        """Close the sockets; a pending iteration ends with ``StopAsyncIteration``."""
        if self._closed:
            return
        self._closed = True
        if self._step is not None and not self._step.done():
            self._step.cancel()
            with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
                await self._step
        if self._sub is not None:
            # Stop the monitor while its reader still runs: libzmq's disable blocks for
            # good if the monitor's PAIR socket is already closed.
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        if self._monitor_task is not None and not self._monitor_task.done():
            # The reader ends on MONITOR_STOPPED.
            with contextlib.suppress(TimeoutError, asyncio.CancelledError, zmq.ZMQError):
                await asyncio.wait_for(self._monitor_task, 1.0)
        if self._sub is not None:
            if self.bind:  # release the endpoint now, for a successor that binds it
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.unbind(self.endpoint)
            self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)

    async def __aenter__(self) -> ZmqEventSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- iteration -----------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[SubscriberItem]:
        return self

    async def __anext__(self) -> SubscriberItem:
        while True:
            item = await self._next_pending()
            if type(item) is not _Undecoded:
                # An exact-type check mypy does not narrow on (isinstance would cost more).
                return item  # type: ignore[return-value]
            received = self._decode(item)
            if received is not None:
                return received

    async def _next_pending(self) -> SubscriberItem | _Undecoded:
        if not self._started:
            await self.start()
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            if self._step is None:
                # Fast path: in-order messages already queued need no task and no await.
                frames = self._recv_nowait()
                if frames is None:
                    step = self._next_message()
                else:
                    seq = self._in_order(frames)
                    if seq is None:
                        continue
                    step = self._heal(seq, frames[2])
                self._step = asyncio.get_running_loop().create_task(step)
            try:
                # Shielded: a caller giving up (wait_for) must not abort a replay half-way;
                # the next call picks up the same step.
                await asyncio.shield(self._step)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed and (task is None or task.cancelling() == 0):
                    raise StopAsyncIteration from None  # close() ended the step
                raise
            except zmq.ZMQError:
                if self._closed:
                    raise StopAsyncIteration from None
                raise
            finally:
                if self._step is not None and self._step.done():
                    self._step = None
        if self._closed:
            raise StopAsyncIteration
        return self._pending.popleft()

    @property
    def backlog(self) -> int:
        """Items received (a replay's answer included) and not yet iterated."""
        return len(self._pending)

    def _recv_nowait(self) -> list[bytes] | None:
        assert self._sub is not None
        try:
            # zmq.asyncio's recv with NOBLOCK returns a finished Future (typed Awaitable).
            future: Any = self._sub.recv_multipart(zmq.NOBLOCK)
            frames: list[bytes] = future.result()
            return frames
        except zmq.Again:
            return None

    async def _next_message(self) -> None:
        assert self._sub is not None
        frames = await self._sub.recv_multipart()
        seq = self._in_order(frames)
        if seq is not None:
            await self._heal(seq, frames[2])

    # -- sequence tracking ---------------------------------------------------------------

    def _in_order(self, frames: list[bytes]) -> int | None:
        """Handle what needs no replay; return the seq when ``_heal`` must take over."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.undecodable += 1
            logger.warning("%s: malformed message with %d frames dropped", self.name, len(frames))
            return None
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        if self._ahead and seq > self._ahead_max:
            self._ahead.clear()  # live stream has caught up with the resume replay
        if self._last_seq is None:
            self._last_seq = seq - 1  # first seq seen: a baseline, not a gap
        if seq == self._last_seq + 1:
            self._accept(seq, payload, replayed=False)
            return None
        if seq <= self._last_seq and self._is_duplicate(seq, payload):
            logger.debug("%s: duplicate seq %d ignored", self.name, seq)
            return None
        return seq

    async def _heal(self, seq: int, payload: bytes) -> None:
        """A gap or a restart before live batch ``seq``: recover, then deliver it."""
        assert self._last_seq is not None
        last = self._last_seq
        if seq > last + 1:
            self.stats.gaps += 1
            logger.warning("%s: gap, seqs %d..%d missing", self.name, last + 1, seq - 1)
            if await self._fill(last + 1, seq, check_anchor=True):
                await self._restart(seq)
            self._accept(seq, payload, replayed=False)
            return
        await self._restart(seq)
        self._accept(seq, payload, replayed=False)

    def _is_duplicate(self, seq: int, payload: bytes) -> bool:
        if seq == self._last_seq and payload == self._last_payload:
            return True
        digest = self._ahead.pop(seq, None)
        return digest is not None and digest == hash(payload)

    async def _restart(self, seq: int) -> None:
        """Publisher restarted: tell the consumer, then recover the new ``0 .. seq-1``."""
        last = self._last_seq if self._last_seq is not None else -1
        logger.warning("%s: publisher restarted (seq %d after %d)", self.name, seq, last)
        self.stats.restarts += 1
        self._pending.append(SourceRestarted(last_seq=last, new_seq=seq))
        self._last_seq = -1
        self._last_payload = None
        self._ahead.clear()
        await self._fill(0, seq, check_anchor=False)

    async def _fill(self, lo: int, hi: int, *, check_anchor: bool) -> bool:
        """Deliver seqs ``lo .. hi-1`` from replay, ``BatchesMissed`` for the rest.

        Returns True (delivering nothing) when the anchor check shows a restart.
        """
        if hi <= lo:
            return False
        if self._dealer is None:
            self._missed(lo, hi - 1)
            return False
        anchor = lo - 1 if check_anchor and lo > 0 and self._last_payload is not None else None
        got = await self._replay(lo if anchor is None else anchor)
        if anchor is not None and anchor in got and got[anchor] != self._last_payload:
            return True
        self._deliver_range(got, lo, hi)
        return False

    async def _resume(self, start: int) -> None:
        """``start_seq`` handling: everything the replay has from ``start`` on, in order."""
        self._last_seq = start - 1
        if self._dealer is None:
            return  # the first live seq will report start .. seq-1 as missed
        got = await self._replay(start)
        if not got:
            return
        self._deliver_range(got, start, max(got) + 1)
        self._ahead = {seq: hash(payload) for seq, payload in got.items()}
        self._ahead_max = max(got)

    def _deliver_range(self, got: dict[int, bytes], lo: int, hi: int) -> None:
        missing_from: int | None = None
        for seq in range(lo, hi):
            payload = got.get(seq)
            if payload is None:
                if missing_from is None:
                    missing_from = seq
                continue
            if missing_from is not None:
                self._missed(missing_from, seq - 1)
                missing_from = None
            self._accept(seq, payload, replayed=True)
        if missing_from is not None:
            self._missed(missing_from, hi - 1)

    def _accept(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self._last_seq = self.stats.last_seq = seq
        self._last_payload = payload
        self._pending.append(_Undecoded(seq, payload, replayed))

    def _decode(self, item: _Undecoded) -> BatchReceived | None:
        seq = item.seq
        try:
            batch = decode_batch(item.payload, token_ids=self.token_ids)
        except Exception as exc:  # a DecodeError, or a decoder bug: bad input never raises
            self.stats.undecodable += 1
            logger.warning("%s: undecodable payload at seq %d skipped: %r", self.name, seq, exc)
            return None
        if item.replayed:
            self.stats.replayed += 1
        else:
            self.stats.received += 1
        return BatchReceived(seq=seq, batch=batch, replayed=item.replayed)

    def _missed(self, first: int, last: int) -> None:
        logger.warning("%s: seqs %d..%d lost", self.name, first, last)
        self.stats.missed += last - first + 1
        self._last_seq = self.stats.last_seq = last
        self._last_payload = None
        self._pending.append(BatchesMissed(first_seq=first, last_seq=last))

    # -- replay client -------------------------------------------------------------------

    def _new_dealer(self) -> zmq.asyncio.Socket:
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a replay may be buffer_steps messages long
        dealer.connect(self.replay_endpoint)
        return dealer

    async def _replay(self, start: int) -> dict[int, bytes]:
        """Ask for every buffered batch from ``start``; return ``{seq: payload}`` received.

        On a timeout the DEALER is replaced, so a late answer cannot be mistaken for the
        answer to a later request; what arrived before the timeout is still returned.
        """
        got: dict[int, bytes] = {}
        try:
            await self._request(start, got)
        except TimeoutError:
            logger.warning(
                "%s: replay from seq %d timed out after %d batches", self.name, start, len(got)
            )
            self._reset_dealer()
        except BaseException:
            self._reset_dealer()  # cancelled mid-stream: the rest of the answer is stale
            raise
        return got

    def _reset_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None if self._closed else self._new_dealer()

    async def _request(self, start: int, got: dict[int, bytes]) -> None:
        dealer = self._dealer
        assert dealer is not None
        timeout_ms = max(1, int(self.replay_timeout * 1000))
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not await dealer.poll(timeout_ms):  # POLLIN: the default flags
                raise TimeoutError
            frames = await dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # DEALER sees ROUTER's empty delimiter
            if len(frames) == 3:
                frames = frames[1:]  # vLLM >= 0.33 adds the topic
            if len(frames) != 2:
                self.stats.undecodable += 1
                continue
            seq_bytes, payload = frames
            if seq_bytes == END_SEQ or payload == b"":
                return
            if len(seq_bytes) != 8:
                self.stats.undecodable += 1
                continue
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= start:
                got[seq] = payload

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Count SUB re-connections (ZMQ reconnects by itself; this makes it visible)."""
        connected_once = False
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                kind = event["event"]
                if kind == zmq.EVENT_MONITOR_STOPPED:
                    return
                if kind == zmq.EVENT_DISCONNECTED:
                    logger.info("%s: disconnected from %s", self.name, event["endpoint"])
                elif connected_once:
                    self.stats.reconnects += 1
                    logger.info("%s: reconnected to %s", self.name, event["endpoint"])
                else:
                    connected_once = True
        except zmq.ZMQError:
            pass
        finally:
            monitor.close(linger=0)
