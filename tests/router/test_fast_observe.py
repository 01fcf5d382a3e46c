"""``FastObserve``, ``FastCounter`` and ``FastGauge`` write a child's values themselves: what
``/metrics`` shows must be exactly what prometheus_client's own methods would have shown."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.metrics import FastCounter, FastGauge, FastObserve

BUCKETS = (1e-4, 2.5e-4, 1e-3, 0.01, 0.1)
VALUES = [0.0, 5e-5, 1e-4, 1.0000001e-4, 2.5e-4, 9e-4, 1e-3, 0.05, 0.1, 0.5, 7.0, math.inf,
          math.nan, -1.0]  # fmt: skip


def _exposition(fast: bool) -> bytes:
    reg = CollectorRegistry()
    h = Histogram("t_seconds", "t", ["stage"], registry=reg, buckets=BUCKETS)
    child = h.labels("parse")
    observe = FastObserve(child).observe if fast else child.observe
    for v in VALUES:
        observe(v)
    lines = generate_latest(reg).splitlines()
    return b"\n".join(line for line in lines if b"_created" not in line)  # a timestamp


def test_fast_observe_exposes_what_the_child_would():
    fast = _exposition(True)
    assert fast == _exposition(False)
    assert b't_seconds_bucket{le="0.0001",stage="parse"} 4.0' in fast  # le is inclusive


def test_fast_observe_takes_its_own_path_only_on_plain_in_process_values():
    reg = CollectorRegistry()
    child = Histogram("u_seconds", "u", registry=reg, buckets=BUCKETS)
    assert FastObserve(child).observe != child.observe

    class Odd:  # not a prometheus_client child of the layout it knows: delegate
        def observe(self, amount: float) -> None: ...

    odd = Odd()
    assert FastObserve(odd).observe == odd.observe


def _counters_and_gauges(fast: bool) -> bytes:
    reg = CollectorRegistry()
    c = Counter("t_requests", "t", ["outcome"], registry=reg).labels("ok")
    g = Gauge("t_inflight", "t", ["instance"], registry=reg).labels("a")
    inc = FastCounter(c).inc if fast else c.inc
    set_ = FastGauge(g).set if fast else g.set
    for v in (1, 1, 2.5, 0):
        inc(v)
    for v in (3, 0, 7, 2):
        set_(v)
    inc()
    lines = generate_latest(reg).splitlines()
    return b"\n".join(line for line in lines if b"_created" not in line)


def test_fast_counters_and_gauges_expose_what_the_child_would():
    fast = _counters_and_gauges(True)
    assert fast == _counters_and_gauges(False)
    assert b't_requests_total{outcome="ok"} 5.5' in fast
    assert b't_inflight{instance="a"} 2.0' in fast


def test_fast_counters_and_gauges_delegate_where_values_are_not_plain():
    class Odd:  # e.g. multiprocess mode: no in-process MutexValue
        def inc(self, amount: float = 1) -> None: ...

        def set(self, value: float) -> None: ...

    odd = Odd()
    assert FastCounter(odd).inc == odd.inc
    assert FastGauge(odd).set == odd.set
