"""Prometheus metrics of the simulated engine, named like vLLM's where vLLM has them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric


def merged_registry(registries: Sequence[CollectorRegistry]) -> CollectorRegistry:
    """One exposition for several ranks' registries: each family once, with every rank's
    samples (told apart by their ``engine`` label), as one vLLM server exports them."""
    if len(registries) == 1:
        return registries[0]

    class _Merged:
        def collect(self) -> Iterator[Metric]:
            families: dict[str, Metric] = {}
            for reg in registries:
                for m in reg.collect():
                    if m.name not in families:
                        families[m.name] = Metric(m.name, m.documentation, m.type, m.unit)
                    families[m.name].samples.extend(m.samples)
            yield from families.values()

    out = CollectorRegistry(auto_describe=False)
    out.register(_Merged())
    return out


class EngineMetrics:
    """One registry per engine (several engines can live in one test process)."""

    def __init__(
        self,
        model_name: str,
        block_size: int | None = None,
        engine: int = 0,
    ) -> None:
        # vLLM labels each data-parallel rank's series with ``engine`` (its index).
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name, "engine": str(engine)}
        if block_size is not None:
            # vLLM's info gauge: routers read the block size the engine really uses here
            # before its first KV event arrives.
            Gauge(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                ["block_size", "enable_prefix_caching", "engine"],
                registry=r,
            ).labels(str(block_size), "True", str(engine)).set(1)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.gpu_usage = gauge("vllm:kv_cache_usage_perc", "GPU KV cache usage (0-1).")
        self.cpu_usage = gauge("kvroute:cpu_kv_cache_usage_perc", "CPU offload tier usage (0-1).")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens hit on the GPU.")
        self.cpu_hits = counter("kvroute:cpu_prefix_cache_hits", "Prompt tokens loaded from CPU.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = counter("vllm:request_success", "Requests finished.")
        self.preemptions = counter("vllm:num_preemptions", "Recompute preemptions.")
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (simulated clock, scaled).",
            list(labels),
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        ).labels(**labels)

    def on_admitted(self, prompt_tokens: int, gpu_hit: int, cpu_hit: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(gpu_hit)
        self.cpu_hits.inc(cpu_hit)

    def refresh(self, running: int, waiting: int, gpu_usage: float, cpu_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.gpu_usage.set(gpu_usage)
        self.cpu_usage.set(cpu_usage)
