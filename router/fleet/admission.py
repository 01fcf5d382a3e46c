"""Admission control: hold requests back while every instance of their pool is busy.

An instance is *busy* when any configured threshold is reached: the engine's waiting
queue (``vllm:num_requests_waiting``), its KV usage (``vllm:kv_cache_usage_perc``, a
fraction), both as of the last health probe, or the router's own in-flight count (sent
and not finished: before and after the first byte). While some instance of the pool is
not busy, requests pass at once and are routed among those (a busy instance is no
candidate, whatever it has cached). When all are busy, a request waits in a bounded FIFO
queue until one frees up, or its wait times out; a full queue or a timeout answers 429
with ``Retry-After``. Off by default: with no threshold set nothing is ever busy.

Engine metrics move only at each probe, so they gate coarsely; the router's in-flight
count moves with every request, so it is precise: a request let through holds a slot
(``Ticket``) from admission until its forward has started, and the queue is drained one
request per free slot -- a freed slot never lets a whole queue through at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.config import AdmissionSettings
from router.fleet.instances import Instance

__all__ = ["AdmissionConfig", "AdmissionController", "Rejected", "Ticket"]

log = logging.getLogger(__name__)


# Its settings (defaults and bounds: ``router.config.AdmissionSettings``).
AdmissionConfig = AdmissionSettings


@dataclass(frozen=True, slots=True)
class Rejected:
    """Why a request was turned away (``queue_full`` or ``timeout``) and when to retry."""

    reason: str
    retry_after_s: int
    message: str


class Ticket:
    """A slot held from admission until the request's forward has started (``release``),
    counted against the instances of its pool only."""

    __slots__ = ("_owner", "pool_ids")

    def __init__(self, owner: AdmissionController | None, pool_ids: frozenset[int]) -> None:
        self._owner = owner
        self.pool_ids = pool_ids

    def release(self) -> None:
        if self._owner is not None:
            owner, self._owner = self._owner, None
            owner._release(self)


def _ids(pool: Sequence[Instance]) -> frozenset[int]:
    return frozenset(id(i) for i in pool)


def router_load(inst: Instance) -> int:
    """Requests the router has in flight to ``inst``: waiting for, or streaming, a body."""
    return inst.inflight_requests + inst.running_requests


class AdmissionController:
    def __init__(self, config: AdmissionConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self._pending: set[Ticket] = set()  # admitted, forward not started yet
        self._queue: collections.deque[tuple[asyncio.Future[Ticket], Sequence[Instance]]] = (
            collections.deque()
        )
        r = registry or CollectorRegistry()
        self.depth = Gauge(
            "kvroute_router_admission_queue_depth", "Requests waiting for a free instance.",
            registry=r,
        )  # fmt: skip
        self.depth.set_function(lambda: len(self._queue))  # read when scraped
        self.wait_seconds = Histogram(
            "kvroute_router_admission_wait_seconds", "Time admitted requests waited.",
            registry=r, buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )  # fmt: skip
        self.rejections = Counter(
            "kvroute_router_admission_rejections", "Requests answered 429 (queue_full/timeout).",
            ["reason"], registry=r,
        )  # fmt: skip

    # ---- the thresholds ---------------------------------------------------------------

    def busy_reason(self, inst: Instance) -> str | None:
        """Which threshold ``inst`` has reached, or None."""
        c = self.config
        if c.max_waiting is not None and inst.engine_waiting >= c.max_waiting:
            return f"engine_waiting {inst.engine_waiting} >= {c.max_waiting}"
        usage = inst.engine_stats.get("kv_gpu_usage")
        if c.max_kv_usage is not None and usage is not None and usage >= c.max_kv_usage:
            return f"kv_usage {usage:.3f} >= {c.max_kv_usage}"
        if c.max_inflight is not None and router_load(inst) >= c.max_inflight:
            return f"inflight {router_load(inst)} >= {c.max_inflight}"
        return None

    def _has_room(self, pool: Sequence[Instance]) -> bool:
        """Some instance of ``pool`` is not busy, counting admitted-not-yet-sent requests
        against the router's in-flight slots."""
        open_ = [i for i in pool if i.healthy and self.busy_reason(i) is None]
        if not open_:
            return False
        m = self.config.max_inflight
        if m is None:
            return True
        ids = _ids(pool)
        pending = sum(1 for t in self._pending if t.pool_ids & ids)
        return sum(max(0, m - router_load(i)) for i in open_) > pending

    def open_instances(self, pool: Sequence[Instance]) -> list[Instance]:
        """The instances of ``pool`` under every threshold: where an admitted request
        goes (a busy instance is no candidate while another is free); all when off."""
        if not self.config.enabled:
            return list(pool)
        open_ = [i for i in pool if self.busy_reason(i) is None]
        return open_ or list(pool)

    # ---- admission --------------------------------------------------------------------

    async def admit(self, pool: Sequence[Instance]) -> Ticket | Rejected:
        """A ticket once ``pool`` has room (at once, or after queueing), or why not."""
        if not self.config.enabled or not pool:
            return Ticket(None, frozenset())
        if not self._queued_for(pool) and self._has_room(pool):
            self.wait_seconds.observe(0.0)
            return self._issue(pool)
        c = self.config
        if len(self._queue) >= c.queue_size:
            return self._reject("queue_full", f"admission queue full ({c.queue_size} waiting)")
        fut: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        entry = (fut, pool)
        self._queue.append(entry)
        t0 = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for loses a client's
            # cancellation that lands as the ticket is issued.
            async with asyncio.timeout(c.timeout_s):
                ticket = await asyncio.shield(fut)
        except TimeoutError:
            if not fut.done():
                self._queue.remove(entry)
                return self._reject(
                    "timeout", f"every instance busy for {c.timeout_s:g} s; try later"
                )
            ticket = fut.result()  # admitted at the very instant it timed out
        except asyncio.CancelledError:  # the client went away while queued
            if entry in self._queue:
                self._queue.remove(entry)
            elif fut.done():
                fut.result().release()
            raise
        self.wait_seconds.observe(time.monotonic() - t0)
        return ticket

    def _issue(self, pool: Sequence[Instance]) -> Ticket:
        ticket = Ticket(self, _ids(pool))
        self._pending.add(ticket)
        return ticket

    def _reject(self, reason: str, message: str) -> Rejected:
        self.rejections.labels(reason).inc()
        c = self.config
        after = c.retry_after_s if c.retry_after_s is not None else c.timeout_s
        return Rejected(reason, max(1, math.ceil(after)), message)

    def _release(self, ticket: Ticket) -> None:
        self._pending.discard(ticket)
        self.notify()

    def _queued_for(self, pool: Sequence[Instance]) -> bool:
        """Someone already waits for an instance of ``pool``: a newcomer queues behind."""
        ids = _ids(pool)
        return any(ids & _ids(p) for _, p in self._queue)

    def notify(self) -> None:
        """Capacity may have changed (a request ended, a probe read new metrics): admit
        queued requests, oldest first, each once its pool has room. Requests for another
        model's pool are not held up behind a full one."""
        for entry in list(self._queue):
            fut, pool = entry
            if fut.done():  # timed out at the same instant; its waiter removes it
                continue
            if self._has_room(pool):
                self._queue.remove(entry)
                fut.set_result(self._issue(pool))

    def describe(self, pool: Sequence[Instance]) -> dict[str, Any]:
        """``/debug/route``: thresholds, queue and each instance's busy reason."""
        c = self.config
        return {
            "enabled": c.enabled,
            "max_waiting": c.max_waiting,
            "max_kv_usage": c.max_kv_usage,
            "max_inflight": c.max_inflight,
            "queue_depth": len(self._queue),
            "queue_size": c.queue_size,
            "has_room": (not c.enabled) or self._has_room(pool),
            "busy": {i.url: self.busy_reason(i) for i in pool},
        }
