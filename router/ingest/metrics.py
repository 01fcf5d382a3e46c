"""Prometheus metrics of event ingest (``kvroute_ingest_*``)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from router.metrics import FastCounter, FastGauge, FastObserve


class IngestMetrics:
    """The ``kvroute_ingest_*`` series, registered in ``registry`` (default: the global one)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["instance"], registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["instance"], registry=reg)

        self.events = Counter(
            "kvroute_ingest_events",
            "KV events by instance, type and status (applied; stale: already applied; "
            "error: the index failed; invalid: impossible group_idx, dropped).",
            ["instance", "type", "status"],
            registry=reg,
        )
        self.batches = Counter(
            "kvroute_ingest_batches", "Batches handled.", ["instance", "source"], registry=reg
        )
        self.replays = counter("kvroute_ingest_replayed_batches", "Batches recovered by replay.")
        self.gaps = counter("kvroute_ingest_gaps", "Sequence gaps.")
        self.restarts = counter("kvroute_ingest_restarts", "Publisher restarts seen.")
        self.missed = counter("kvroute_ingest_missed_batches", "Batches lost for good.")
        self.undecodable = counter("kvroute_ingest_undecodable", "Malformed payloads skipped.")
        self.resyncs = counter("kvroute_ingest_resyncs", "Instance cleared and rebuilt.")
        self.errors = counter("kvroute_ingest_errors", "Index or source failures.")
        self.lag = gauge("kvroute_ingest_lag_seconds", "now - ts of the last live batch.")
        self.lag_hist = Histogram(
            "kvroute_ingest_batch_lag_seconds",
            "now - batch ts, live batches.",
            buckets=(1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0),
            registry=reg,
        )
        self.last_seq = gauge("kvroute_ingest_last_seq", "Last sequence number handled.")


class FeedMetrics:
    """One instance's children of the per-batch series, bound once: ``labels()`` takes a
    lock and a lookup per call, and every batch made six of them. The gauges are bound at
    their first value: until a live batch there is no lag to show, not a lag of 0."""

    def __init__(self, metrics: IngestMetrics, instance: str) -> None:
        self._metrics = metrics
        self._instance = instance
        self._by_kind: dict[tuple[str, str], FastCounter] = {}
        self._lag: FastGauge | None = None
        self._last_seq: FastGauge | None = None
        self.live_batches = FastCounter(metrics.batches.labels(instance, "live"))
        self.replay_batches = FastCounter(metrics.batches.labels(instance, "replay"))
        self.replays = FastCounter(metrics.replays.labels(instance))
        self.lag_hist = FastObserve(metrics.lag_hist)  # the histogram has no instance label

    def events(self, kind: str, status: str) -> FastCounter:
        """``kvroute_ingest_events{instance, type=kind, status}``."""
        c = self._by_kind.get((kind, status))
        if c is None:
            child = self._metrics.events.labels(self._instance, kind, status)
            c = self._by_kind[kind, status] = FastCounter(child)
        return c

    @property
    def lag(self) -> FastGauge:
        if self._lag is None:
            self._lag = FastGauge(self._metrics.lag.labels(self._instance))
        return self._lag

    @property
    def last_seq(self) -> FastGauge:
        if self._last_seq is None:
            self._last_seq = FastGauge(self._metrics.last_seq.labels(self._instance))
        return self._last_seq
