"""The router's Prometheus metrics (one registry per router; ingest adds its own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_ERR_BUCKETS = (-4096, -1024, -256, -64, -16, -1, 0, 1, 16, 64, 256, 1024, 4096)


class RouterMetrics:
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
        self.decision_seconds = Histogram(
            "kvroute_router_decision_seconds", "Tokenize + hash + score + choose.", registry=r,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1),
        )  # fmt: skip
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

    def observe_prediction(self, predicted: tuple[int, int], reported: tuple[int, int]) -> None:
        for tier, p, q in (("gpu", predicted[0], reported[0]), ("cpu", predicted[1], reported[1])):
            self.predicted.labels(tier).inc(p)
            self.reported.labels(tier).inc(q)
        diff = sum(predicted) - sum(reported)
        self.prediction_error.observe(diff)
        self.exactness.labels("exact" if diff == 0 else "over" if diff > 0 else "under").inc()
