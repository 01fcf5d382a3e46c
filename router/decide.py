"""From an OpenAI body to a ranked list of instances, with the reasons.

tokenize (the engine's tokenizer) -> block hashes (vLLM's, events.hashing) -> per instance
(gpu, cpu) hit from the index (router.score) and the speculative prefix of recently routed
requests -> the policy's ranking. If the index is unreachable the request is still routed,
on load alone, and the failure is counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from events.hashing import hash_request_blocks, wire_hash
from router.index.base import NUM_TIERS, BlockIndex
from router.instances import Instance, InstanceRegistry
from router.metrics import RouterMetrics
from router.policy import Candidate, Decision, Policy
from router.score import Score, Scorer
from router.speculative import SpeculativeResidency
from router.tokenize import RoutingTokenizer

__all__ = ["RouteDecision", "Router"]

log = logging.getLogger(__name__)


@dataclass
class RouteDecision:
    decision: Decision
    prompt_tokens: int
    block_hashes: list[int]
    scores: dict[str, Score]
    speculative_tokens: dict[str, int]
    candidates: dict[str, Candidate]
    index_ok: bool
    elapsed_s: float

    def predicted(self, instance: str) -> tuple[int, int]:
        c = self.candidates.get(instance)
        return (c.gpu_tokens, c.cpu_tokens) if c else (0, 0)

    def uncached(self, instance: str) -> int:
        gpu, cpu = self.predicted(instance)
        return max(self.prompt_tokens - gpu - cpu, 1)


class Router:
    def __init__(
        self,
        *,
        registry: InstanceRegistry,
        scorer: Scorer,
        index: BlockIndex,
        policy: Policy,
        tokenizer: RoutingTokenizer,
        speculative: SpeculativeResidency,
        metrics: RouterMetrics,
        block_size: int,
        hash_algo: str,
        seed: str | None,
    ) -> None:
        self.registry = registry
        self.scorer = scorer
        self.index = index
        self.policy = policy
        self.tokenizer = tokenizer
        self.speculative = speculative
        self.metrics = metrics
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.seed = seed

    async def decide(self, body: dict[str, Any], kind: str) -> RouteDecision | None:
        """None when no instance is healthy."""
        t0 = time.perf_counter()
        healthy = self.registry.healthy()
        if not healthy:
            return None
        ids = await self.tokenizer.prompt_ids(body, kind)
        n_tokens = len(ids) if ids is not None else 0
        hashes: list[int] = []
        if ids and self.policy.uses_scores:
            hashes = [
                wire_hash(h)
                for h in hash_request_blocks(ids, self.block_size, self.hash_algo, self.seed)
            ]
        urls = [i.url for i in healthy]
        scores: dict[str, Score] = {}
        spec: dict[str, int] = {}
        index_ok = True
        if hashes:
            try:
                scores = await self.scorer.score(hashes, n_tokens, urls)
            except Exception:
                index_ok = False
                self.metrics.index_errors.inc()
                log.warning("index lookup failed; routing on load only", exc_info=True)
            cap = ((n_tokens - 1) // self.block_size) * self.block_size
            spec = {
                u: min(b * self.block_size, cap)
                for u, b in self.speculative.prefix_blocks(hashes, urls).items()
            }
        candidates = {
            i.url: self._candidate(i, scores.get(i.url), spec.get(i.url, 0)) for i in healthy
        }
        decision = self.policy.choose(list(candidates.values()), max(n_tokens, 1))
        elapsed = time.perf_counter() - t0
        self.metrics.decision_seconds.observe(elapsed)
        return RouteDecision(
            decision, n_tokens, hashes, scores, spec, candidates, index_ok, elapsed
        )

    @staticmethod
    def _candidate(inst: Instance, score: Score | None, spec_tokens: int) -> Candidate:
        gpu, cpu = (score.gpu_tokens, score.cpu_tokens) if score else (0, 0)
        if spec_tokens > gpu + cpu:  # a just-routed request's prefill will leave it on GPU
            gpu, cpu = spec_tokens, 0
        return Candidate(
            name=inst.url,
            gpu_tokens=gpu,
            cpu_tokens=cpu,
            inflight_requests=inst.inflight_requests,
            inflight_prefill_tokens=inst.inflight_prefill_tokens,
            running_requests=inst.running_requests,
            engine_waiting=inst.engine_waiting,
        )

    def routed(self, decision: RouteDecision, instance: str) -> None:
        """Predict-on-route: the chosen instance will hold the prompt's blocks soon."""
        if decision.block_hashes:
            self.speculative.record(instance, decision.block_hashes)

    async def explain(self, decision: RouteDecision) -> dict[str, Any]:
        """``/debug/route``: per instance hits per tier and group, queue terms, TTFT."""
        groups: dict[str, dict[str, Any]] = {}
        if decision.block_hashes and decision.index_ok:
            try:
                found = await self.index.lookup(decision.block_hashes, list(decision.candidates))
            except Exception:
                found = {}
            for url, res in found.items():
                per: dict[str, Any] = {}
                for slot, mask in sorted(res.items()):
                    g, tier = divmod(slot, NUM_TIERS)
                    per[f"group{g}.{'gpu' if tier == 0 else 'cpu'}"] = {
                        "prefix_blocks": ((mask + 1) & ~mask).bit_length() - 1,
                        "resident_blocks": mask.bit_count(),
                    }
                groups[url] = per
        layouts = self.scorer.layouts
        out = []
        for url in decision.decision.ranked:
            c = decision.candidates[url]
            part = decision.decision.breakdown.get(url)
            layout = layouts.get(url)
            out.append(
                {
                    "instance": url,
                    "gpu_tokens": c.gpu_tokens,
                    "cpu_tokens": c.cpu_tokens,
                    "index_score": list(decision.scores.get(url, Score(0, 0))),
                    "speculative_tokens": decision.speculative_tokens.get(url, 0),
                    "groups": groups.get(url, {}),
                    "layout": layout.to_dict() if layout else None,
                    "inflight_requests": c.inflight_requests,
                    "inflight_prefill_tokens": c.inflight_prefill_tokens,
                    "running_requests": c.running_requests,
                    "engine_waiting": c.engine_waiting,
                    "queue_s": part.queue_s if part else None,
                    "prefill_s": part.prefill_s if part else None,
                    "load_s": part.load_s if part else None,
                    "predicted_ttft_s": part.ttft_s if part else None,
                }
            )
        return {
            "instance": decision.decision.instance,
            "policy": self.policy.name,
            "prompt_tokens": decision.prompt_tokens,
            "num_blocks": len(decision.block_hashes),
            "index_ok": decision.index_ok,
            "decision_ms": decision.elapsed_s * 1e3,
            "candidates": out,
        }
