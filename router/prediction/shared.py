"""Replicas that act as one: predict-on-route records and in-flight load shared over Redis.

Router replicas on one Redis index see the same engine events, but each one's
predict-on-route records (what it has just routed, until the engine's events tell) and its
in-flight counts are its own: a burst split across replicas scatters, and each replica's
load terms miss the others' requests. ``SharedPredictions`` shares both through the Redis
that holds the index, on one pub/sub channel per index namespace, off the request path:

- The request path only appends to a local queue (``record`` / ``settle`` / ``applied``,
  called by predict-on-route's owner) and wakes a background publisher; the publisher
  sends what queued as one message (pipelined: whatever queues while a publish is on the
  wire goes in the next one) together with this replica's in-flight load per instance.
- A background subscriber applies the other replicas' messages to a peer store (a
  ``SpeculativeResidency`` of its own, the same refcounts and TTL), which ``residency``
  reads and predict-on-route ORs into its own; their loads land on each ``Instance``
  (``peer_*`` fields) that the policy adds to this replica's own counts.
- Bounded staleness: a record reaches the others one publish + one delivery later
  (measured: ``kvroute_replica_share_staleness_seconds``, the sender's wall clock to the
  receiver's, so loopback-accurate); the load is republished whenever it changes (checked
  every ``load_interval_s``) and at least every ``heartbeat_s``.
- Nothing stale outlives a replica: pub/sub keeps nothing in Redis; a peer's records
  expire in the receivers' stores by their TTL (the same ``speculative_ttl_s``), counted
  from receipt; a peer whose messages stop for ``peer_timeout_s`` has its load dropped.
- Settling follows the owner's rule: a peer's answered request gives way to the index at
  the next batch applied to the shared index, by any replica (``applied`` is published:
  a replica that does not ingest -- ``--workers`` beyond the first -- flushes its own
  settled records on it too, through ``on_applied``).

Only built with a Redis index: with the memory index a router is one replica, and nothing
here runs. On a Redis Cluster index ``redis`` is ``router.index.redis_cluster.ClusterPubSub``
(one node at a time: cluster pub/sub is broadcast), which moves to another node when the
one in use fails: the receive loop's resubscription then lands there.

Messages are msgpack ``[replica, sent_wall_s, ops, load]``; an op is
``["r", instance, key, [[group, hashes], ...], whole]`` (record; a key recorded again
replaces its blocks), ``["s", instance, key]`` (settle) or ``["f", instance]`` (a batch of
the instance was applied). A message that does not decode is counted and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from router.index.base import Residency
from router.prediction.speculative import Held, SpeculativeResidency

__all__ = ["SharedPredictions", "merge_residency"]

log = logging.getLogger(__name__)

# instance -> (requests in flight, their prefill tokens, streams open)
Load = dict[str, tuple[int, int, int]]


def merge_residency(own: dict[str, Residency], other: dict[str, Residency]) -> dict[str, Residency]:
    """``own`` with ``other``'s slot masks ORed in (``own`` is updated and returned)."""
    for name, res in other.items():
        mine = own.get(name)
        if mine is None:
            own[name] = dict(res)
            continue
        for slot, mask in res.items():
            mine[slot] = mine.get(slot, 0) | mask
    return own


class SharedPredictions:
    """One replica's end of the share (see module docstring). ``redis``: a
    ``redis.asyncio`` client of the index's Redis; ``load``: this replica's in-flight load
    now; ``set_peer_load``: where the other replicas' summed load goes (instance -> sums;
    an instance absent has none)."""

    def __init__(
        self,
        redis: Any,
        channel: str,
        *,
        ttl_s: float,
        load: Callable[[], Load],
        set_peer_load: Callable[[Load], None],
        on_applied: Callable[[str], None] | None = None,
        replica: str | None = None,
        load_interval_s: float = 0.01,
        heartbeat_s: float = 0.1,
        peer_timeout_s: float = 0.5,
        metrics: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.channel = channel
        self.replica = replica or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.peers = SpeculativeResidency(ttl_s, clock=clock)
        self._load = load
        self._set_peer_load = set_peer_load
        self.on_applied = on_applied
        self.load_interval_s = load_interval_s
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.metrics = metrics  # router.metrics.RouterMetrics (staleness, drops) or None
        self._clock = clock
        self._ops: list[list[Any]] = []
        self._wake = asyncio.Event()
        # (peer, key) -> its handle in ``peers``; with (expiry, peer, key) in arrival order
        # (one TTL: expiry order) so what expired leaves without a scan.
        self._handles: dict[tuple[str, int], Held] = {}
        self._order: deque[tuple[float, str, int]] = deque()
        self._peer_loads: dict[str, tuple[float, Load]] = {}
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._tasks: list[asyncio.Task[None]] = []
        self._pubsub: Any = None
        self.staleness: deque[float] = deque(maxlen=4096)  # seconds, latest receipts
        self.sent = 0
        self.received = 0
        self.dropped = 0

    # ---- the request path (no I/O: queued for the publisher) --------------------------

    def record(self, instance: str, key: int, held: Mapping[int, list[int]], whole: int) -> None:
        """This replica recorded ``held`` (group -> hashes) for request ``key`` there."""
        self._ops.append(["r", instance, key, [[g, hs] for g, hs in held.items()], whole])
        self._wake.set()

    def settle(self, instance: str, key: int) -> None:
        """This replica's request ``key`` on ``instance`` ended."""
        self._ops.append(["s", instance, key])
        self._wake.set()

    def applied(self, instance: str) -> None:
        """This replica applied a batch of ``instance``'s events to the shared index."""
        self.peers.flush(instance)
        self._ops.append(["f", instance])
        self._wake.set()

    def residency(self, hashes: Sequence[int], instances: Iterable[str]) -> dict[str, Residency]:
        """The other replicas' predicted GPU residency over ``hashes``' positions."""
        return self.peers.residency(hashes, instances)

    def forget(self, instance: str) -> None:
        """The instance is down or gone here: drop what the others predicted on it."""
        self.peers.forget(instance)

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe (before returning: nothing published after it is missed), then run
        the publisher and the subscriber in the background."""
        self._pubsub = self.redis.pubsub()
        await self._pubsub.subscribe(self.channel)
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="replicas-publish"),
            asyncio.create_task(self._receive_loop(), name="replicas-receive"),
        ]
        log.info("replica %s shares predictions on %s", self.replica, self.channel)

    async def close(self) -> None:
        # Cancel until each task ended: a cancellation can be lost where it lands as a
        # wait inside redis-py or asyncio completes (Python 3.11), and one lost cancel
        # must not leave close() waiting for good. asyncio.wait never swallows close()'s
        # own cancellation.
        for _ in range(100):
            pending = [t for t in self._tasks if not t.done()]
            if not pending:
                break
            for t in pending:
                t.cancel()
            await asyncio.wait(pending, timeout=0.1)
        else:
            log.warning("replica share: a task did not stop after 100 cancellations")
        for t in self._tasks:  # retrieve what each ended with (never re-raised here)
            if t.done() and not t.cancelled():
                t.exception()
        self._tasks = []
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
            self._pubsub = None

    # ---- publisher ----------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        last_load: Load | None = None
        last_sent = 0.0
        while True:
            if not self._ops:
                # Idle (nothing in flight): only a request changes the load, and its
                # record wakes this task; so poll the load only while some is in flight.
                wait = self.load_interval_s if last_load else self.heartbeat_s
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a
                # cancellation that lands as the event fires, and close() then waits on
                # this loop for good.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
            self._wake.clear()
            load = self._load()
            now = self._clock()
            if not self._ops and load == last_load and now - last_sent < self.heartbeat_s:
                continue
            ops, self._ops = self._ops, []
            payload = self._enc.encode([self.replica, time.time(), ops, load])
            try:
                await self.redis.publish(self.channel, payload)
            except Exception:  # Redis away: the index fails too; keep trying, lose these
                log.warning("replica share: publish failed", exc_info=True)
                await asyncio.sleep(self.heartbeat_s)
                continue
            self.sent += 1
            last_load, last_sent = load, now

    # ---- subscriber ---------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            try:
                msg = await self._pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=self.heartbeat_s
                )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("replica share: receive failed; resubscribing", exc_info=True)
                await asyncio.sleep(self.heartbeat_s)
                with contextlib.suppress(Exception):
                    await self._pubsub.subscribe(self.channel)
                continue
            if msg is not None and msg.get("type") == "message":
                self.apply(msg["data"])
            self._expire()

    def apply(self, data: bytes) -> None:
        """One message from the channel (this replica's own are ignored)."""
        try:
            replica, sent, ops, load = self._dec.decode(data)
            if replica == self.replica:
                return
            for op in ops:
                self._apply_op(replica, op)
            peer_load = {str(k): (int(v[0]), int(v[1]), int(v[2])) for k, v in load.items()}
        except Exception as exc:  # a message we cannot read: counted, dropped
            self.dropped += 1
            if self.metrics is not None:
                self.metrics.replica_share_dropped.inc()
            log.warning("replica share: dropped a message that does not decode: %s", exc)
            return
        self.received += 1
        lag = max(time.time() - float(sent), 0.0)
        self.staleness.append(lag)
        if self.metrics is not None:
            self.metrics.replica_share_staleness.observe(lag)
        before = self._peer_loads.get(replica)
        self._peer_loads[replica] = (self._clock(), peer_load)
        if before is None or before[1] != peer_load:
            self._sum_loads()

    def _apply_op(self, replica: str, op: list[Any]) -> None:
        kind, instance = op[0], op[1]
        if kind == "r":
            key, held, whole = (replica, int(op[2])), {int(g): hs for g, hs in op[3]}, op[4]
            old = self._handles.pop(key, None)
            if old is not None:
                self.peers.release(instance, old)
            handle = self.peers.record(instance, held, int(whole))
            if handle is not None:
                self._handles[key] = handle
                self._order.append((handle.expiry, replica, key[1]))
        elif kind == "s":
            handle = self._handles.pop((replica, int(op[2])), None)
            if handle is not None:
                self.peers.settle(instance, handle)
        elif kind == "f":
            self.peers.flush(instance)
            if self.on_applied is not None:
                self.on_applied(instance)
        else:
            raise ValueError(f"unknown op {kind!r}")

    def _expire(self) -> None:
        """Forget handles whose TTL passed, and the load of peers gone quiet."""
        now = self._clock()
        order = self._order
        while order and order[0][0] <= now:
            _, replica, key = order.popleft()
            handle = self._handles.get((replica, key))
            if handle is not None and handle.expiry <= now:
                del self._handles[(replica, key)]
        gone = [r for r, (seen, _) in self._peer_loads.items() if now - seen > self.peer_timeout_s]
        for r in gone:
            del self._peer_loads[r]
            log.info("replica %s went quiet: its load is dropped", r)
        if gone:
            self._sum_loads()

    def _sum_loads(self) -> None:
        sums: dict[str, list[int]] = {}
        for _, load in self._peer_loads.values():
            for name, (req, tok, run) in load.items():
                s = sums.setdefault(name, [0, 0, 0])
                s[0] += req
                s[1] += tok
                s[2] += run
        self._set_peer_load({k: (v[0], v[1], v[2]) for k, v in sums.items()})

    def peer_count(self) -> int:
        """Replicas heard from within ``peer_timeout_s``."""
        return len(self._peer_loads)
