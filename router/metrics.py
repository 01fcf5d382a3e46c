"""The router's Prometheus metrics (one registry per router; ingest adds its own).

Hot-path children are bound once (``stage_*``, ``instance(url)``): ``labels()`` costs a
lock and a dict lookup per call, several per request. Their updates go through
``FastObserve`` / ``FastCounter`` / ``FastGauge``: the child's own value written without
its lock, as only the event loop writes them (prometheus_client's methods are three
Python calls and a lock each; a request makes about ten).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.values import MutexValue

# Stages of a proxied request, in order (``kvroute_router_stage_seconds{stage}``).
STAGES = (
    "parse", "tokenize", "hash", "score", "choose", "upstream_headers", "upstream_first_byte",
    "relay",
)  # fmt: skip
_STAGE_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 1, 10,
)  # fmt: skip


class FastObserve:
    """A bound histogram child's ``observe`` in one bisect and two additions, no locks
    (prometheus_client's loops over the buckets taking a lock per step: ~1.6 us, ten per
    request). Only the event loop observes these; exposition is the child's own. Falls
    back to the child where its values are not plain in-process ones (multiprocess)."""

    __slots__ = ("_bounds", "_buckets", "_child", "_sum", "observe")

    def __init__(self, child: Any) -> None:
        self._child = child
        # prometheus_client's private layout (0.20-0.26); any other: the child's own observe.
        self._bounds = tuple(getattr(child, "_upper_bounds", ()))
        self._buckets = getattr(child, "_buckets", ())
        self._sum: Any = getattr(child, "_sum", None)
        plain = (
            len(self._bounds) == len(self._buckets) > 0
            and type(self._sum) is MutexValue
            and all(type(b) is MutexValue for b in self._buckets)
        )
        self.observe = self._observe if plain else child.observe

    def _observe(self, amount: float) -> None:
        self._sum._value += amount
        if amount == amount:  # NaN: in no bucket, as the child does
            self._buckets[bisect_left(self._bounds, amount)]._value += 1


def _plain_value(child: Any) -> Any:
    """The child's in-process ``MutexValue`` (prometheus_client 0.20-0.26), or None where
    it keeps its value elsewhere (multiprocess mode): then its own methods are used."""
    value = getattr(child, "_value", None)
    return value if type(value) is MutexValue else None


class FastCounter:
    """A bound counter child's ``inc`` as one addition (callers pass amounts >= 0, as
    prometheus_client requires; it is not checked again here)."""

    __slots__ = ("_value", "inc")

    def __init__(self, child: Any) -> None:
        self._value = _plain_value(child)
        self.inc = self._inc if self._value is not None else child.inc

    def _inc(self, amount: float = 1) -> None:
        self._value._value += amount


class FastGauge:
    """A bound gauge child's ``set`` as one assignment."""

    __slots__ = ("_value", "set")

    def __init__(self, child: Any) -> None:
        self._value = _plain_value(child)
        self.set = self._set if self._value is not None else child.set

    def _set(self, value: float) -> None:
        self._value._value = float(value)


@dataclass(slots=True)
class InstanceMetrics:
    """One instance's bound children."""

    ok: FastCounter
    upstream_4xx: FastCounter
    upstream_5xx: FastCounter
    connect_error: FastCounter
    broken_stream: FastCounter
    inflight: FastGauge
    running: FastGauge
    ttft: FastObserve


_ERR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096)


class RouterMetrics:
    # One bound child per stage in ``STAGES`` (set in ``__init__``).
    stage_parse: FastObserve
    stage_tokenize: FastObserve
    stage_hash: FastObserve
    stage_score: FastObserve
    stage_choose: FastObserve
    stage_upstream_headers: FastObserve
    stage_upstream_first_byte: FastObserve
    stage_relay: FastObserve

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "kvroute_router_requests", "Requests by chosen instance and outcome.",
            ["instance", "outcome"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "kvroute_router_retries", "Forwards retried (next_instance / same_instance).",
            ["reason"], registry=r,
        )  # fmt: skip
        self.decision_seconds = FastObserve(Histogram(
            "kvroute_router_decision_seconds", "Tokenize + hash + score + choose.", registry=r,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1),
        ))  # fmt: skip
        self.ttft = Histogram(
            "kvroute_router_ttft_seconds", "Time to the first body byte from the instance.",
            ["instance"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )  # fmt: skip
        self.predicted = Counter(
            "kvroute_router_predicted_hit_tokens", "Predicted hit tokens of chosen instances.",
            ["tier"], registry=r,
        )  # fmt: skip
        self.reported = Counter(
            "kvroute_router_reported_hit_tokens", "Hit tokens engines reported (usage.kv_hit).",
            ["tier"], registry=r,
        )  # fmt: skip
        self.exactness = Counter(
            "kvroute_router_predictions", "Predicted vs reported hit: exact, over or under.",
            ["result"], registry=r,
        )  # fmt: skip
        self.prediction_error = Histogram(
            "kvroute_router_prediction_error_tokens", "Predicted minus reported hit tokens.",
            registry=r, buckets=_ERR_BUCKETS,
        )  # fmt: skip
        self.index_errors = Counter(
            "kvroute_router_index_errors", "Lookups that failed (routing fell back to load).",
            registry=r,
        )  # fmt: skip
        self.replica_share_staleness = Histogram(
            "kvroute_replica_share_staleness_seconds",
            "From another replica's publish to its receipt here (its records and load).",
            registry=r, buckets=_STAGE_BUCKETS,
        )  # fmt: skip
        self.replica_share_dropped = Counter(
            "kvroute_replica_share_dropped", "Replica-share messages that did not decode.",
            registry=r,
        )  # fmt: skip
        self.healthy = Gauge(
            "kvroute_router_instance_healthy", "1 if the instance is up.", ["instance"],
            registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "kvroute_router_inflight_requests", "Forwarded, first byte not yet back.",
            ["instance"], registry=r,
        )  # fmt: skip
        self.running = Gauge(
            "kvroute_router_running_requests", "Responses still streaming.", ["instance"],
            registry=r,
        )  # fmt: skip

        self.stage = Histogram(
            "kvroute_router_stage_seconds",
            "Time per stage of a proxied request: parse (read + decode the body), tokenize, "
            "hash, score (index lookup + hit rule), choose (policy), upstream_headers "
            "(connect + send + the engine's response head), upstream_first_byte (from the "
            "forward to the first body byte), relay (streams: first byte to end).",
            ["stage"], registry=r, buckets=_STAGE_BUCKETS,
        )  # fmt: skip
        for name in STAGES:
            setattr(self, f"stage_{name}", FastObserve(self.stage.labels(name)))
        self.retry_next = FastCounter(self.retries.labels("next_instance"))
        self.retry_same = FastCounter(self.retries.labels("same_instance"))
        self._instances: dict[str, InstanceMetrics] = {}

    def instance(self, url: str) -> InstanceMetrics:
        m = self._instances.get(url)
        if m is None:
            req = self.requests
            m = self._instances[url] = InstanceMetrics(
                ok=FastCounter(req.labels(url, "ok")),
                upstream_4xx=FastCounter(req.labels(url, "upstream_4xx")),
                upstream_5xx=FastCounter(req.labels(url, "upstream_5xx")),
                connect_error=FastCounter(req.labels(url, "connect_error")),
                broken_stream=FastCounter(req.labels(url, "broken_stream")),
                inflight=FastGauge(self.inflight.labels(url)),
                running=FastGauge(self.running.labels(url)),
                ttft=FastObserve(self.ttft.labels(url)),
            )
        return m

    def observe_prediction(self, predicted: tuple[int, int], reported: tuple[int, int]) -> None:
        for tier, p, q in (("gpu", predicted[0], reported[0]), ("cpu", predicted[1], reported[1])):
            self.predicted.labels(tier).inc(p)
            self.reported.labels(tier).inc(q)
        diff = sum(predicted) - sum(reported)
        self.prediction_error.observe(diff)
        self.exactness.labels("exact" if diff == 0 else "over" if diff > 0 else "under").inc()
