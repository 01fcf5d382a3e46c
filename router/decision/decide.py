"""From an OpenAI body to a ranked list of instances, with the reasons.

``Router.decide`` tokenizes the prompt (the engine's tokenizer), then, in its numbered
steps: 1. which hash block size each candidate uses (vLLM picks it; its events tell);
2. the prompt's block hashes at each size (vLLM's, ``events.hashing``); 3. per instance
the (gpu, cpu) hit from the index and predict-on-route's residency, by the one hit rule
(``router.decision.score``); 4. the policy's ranking, then session affinity. If the
index is unreachable the request is still routed, on load alone, and the failure is
counted. The ``RouteDecision`` is frozen: what happens to the request afterwards lives
in its ``RoutedRequest`` (``router.decision.request``) and in predict-on-route's owner
(``router.prediction.predict``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from router.decision.policy.base import Candidate, Decision, Policy
from router.decision.prompt_hashes import PromptHashes
from router.decision.score import ZERO, Score, Scorer
from router.decision.tokenize import RoutingTokenizer
from router.fleet.affinity import SessionAffinity
from router.fleet.instances import Instance
from router.index.base import BlockIndex
from router.metrics import RouterMetrics
from router.prediction.predict import PredictOnRoute

__all__ = ["HashInput", "HealthyInstances", "RouteDecision", "Router"]

_new = tuple.__new__

# What a prompt's hashes are made from: token ids, cache_salt, LoRA key.
HashInput = tuple[list[int], str | None, tuple[str, str | None] | None]


class HealthyInstances(Protocol):
    """Where the candidates come from when the caller names none (``InstanceRegistry``)."""

    def healthy(self) -> list[Instance]: ...


def _busy(inst: Instance) -> int:
    """Requests the router has on ``inst``: remote tokenization goes to the least busy
    instance, not always the first (one API server tokenizing for the whole fleet)."""
    return inst.inflight_requests + inst.running_requests


log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One decision, as made: never written afterwards."""

    decision: Decision
    prompt_tokens: int
    # Wire hashes of the prompt per hash block size: instances hash at their own size.
    hashes: dict[int, list[int]]
    hash_size: dict[str, int]  # instance -> its hash block size
    scores: dict[str, Score]
    speculative_blocks: dict[str, int]
    candidates: dict[str, Candidate]
    index_ok: bool
    elapsed_s: float
    affinity: dict[str, Any] | None = None  # router.fleet.affinity's account (/debug/route)
    # To hash again at another block size when an instance's first events name its own.
    hash_input: HashInput | None = None

    def block_hashes(self, instance: str) -> list[int]:
        return self.hashes.get(self.hash_size.get(instance, 0), [])

    def predicted(self, instance: str) -> tuple[int, int]:
        c = self.candidates.get(instance)
        return (c.gpu_tokens, c.cpu_tokens) if c else (0, 0)

    def uncached(self, instance: str) -> int:
        gpu, cpu = self.predicted(instance)
        return max(self.prompt_tokens - gpu - cpu, 1)


@dataclass(kw_only=True, eq=False)
class Router:
    """The routing decision: tokenize, hash, look up, score, choose (``build_router``
    wires one from settings)."""

    registry: HealthyInstances
    scorer: Scorer
    index: BlockIndex
    policy: Policy
    tokenizer: RoutingTokenizer
    prediction: PredictOnRoute
    prompt_hashes: PromptHashes
    metrics: RouterMetrics
    block_size: int  # until an instance's events say otherwise
    affinity: SessionAffinity | None = None

    def hash_block_size(self, instance: str) -> int:
        layout = self.scorer.layouts.get(instance)
        return layout.hash_block_size if layout is not None else self.block_size

    async def decide(
        self,
        body: dict[str, Any],
        kind: str,
        *,
        record: bool = True,
        instances: Sequence[Instance] | None = None,
        lora: tuple[str, str | None] | None = None,
        session: str | None = None,
        predict: bool | None = None,
    ) -> RouteDecision | None:
        """None when no instance is healthy. ``record``: the decision counts (session
        affinity; ``/debug/route`` passes False). ``predict`` (default: ``record``):
        predict-on-route for the chosen instance now, with no await between choosing and
        recording, so a burst's next request already sees it; the proxy passes False and
        records through ``routed`` once the request is written upstream, with no await
        in between either (``RoutedRequest.sent``). ``instances``: the request's pool
        (``router.fleet.models``; default every healthy one); ``lora``: the adapter it
        names, ``(name, path)``, an extra key of every block as in vLLM; ``session``: its
        session key (``router.fleet.affinity``, applied after the ranking)."""
        t0 = time.perf_counter()
        healthy = list(instances) if instances is not None else self.registry.healthy()
        if not healthy:
            return None
        tokenizer = self.tokenizer
        if tokenizer.remote:  # the least busy API server of the pool tokenizes
            at = min(healthy, key=_busy).http_url
            ids, packed = await tokenizer.prompt_ids_packed(body, kind, at)
        else:
            ids, packed = tokenizer.local_ids(body, kind)
        m = self.metrics
        t_hash = time.perf_counter()
        m.stage_tokenize.observe(t_hash - t0)
        n_tokens = len(ids) if ids is not None else 0
        # 1. Which hash block size each candidate uses (vLLM picks it; events tell).
        urls = [i.spec.url for i in healthy]
        layout_of, default_size = self.scorer.layouts.get, self.block_size
        hash_size: dict[str, int] = {}
        for u in urls:
            layout = layout_of(u)
            hash_size[u] = layout.hash_block_size if layout is not None else default_size
        sizes = set(hash_size.values())
        by_size: dict[int, list[str]] = {sizes.pop(): urls} if len(sizes) == 1 else {}
        if sizes:  # instances hashing at different sizes
            for u, size in hash_size.items():
                by_size.setdefault(size, []).append(u)
        # 2. The prompt's block hashes at each size; 3. index + speculative residency,
        # scored by the one hit rule per instance.
        hashes: dict[int, list[int]] = {}
        scores: dict[str, Score] = {}
        spec_blocks: dict[str, int] = {}
        index_ok = True
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        if ids and self.policy.uses_scores:
            for size, group in by_size.items():
                # The engine keys block 0 with the request's cache_salt: a salted request
                # is credited only with blocks stored under the same salt.
                hashes[size] = hs = self.prompt_hashes.wire_hashes(ids, size, salt, lora, packed)
                t_score = time.perf_counter()
                m.stage_hash.observe(t_score - t_hash)
                if not hs:
                    continue
                extra = self.prediction.residency(hs, group)
                for u, res in extra.items():
                    spec_blocks[u] = max(m.bit_count() for m in res.values())
                try:
                    scores.update(await self.scorer.score(hs, n_tokens, group, extra))
                except Exception:
                    index_ok = False
                    self.metrics.index_errors.inc()
                    log.warning("index lookup failed; routing on load only", exc_info=True)
                t_hash = time.perf_counter()
                m.stage_score.observe(t_hash - t_score)
        # 4. The policy ranks the candidates.
        candidates = self._candidates(healthy, urls, scores)
        decision = self.policy.choose(list(candidates.values()), max(n_tokens, 1))
        affinity = None
        if self.affinity is not None:
            decision, affinity = self.affinity.apply(decision, session, record=record)
        t_end = time.perf_counter()
        m.stage_choose.observe(t_end - t_hash)
        elapsed = t_end - t0
        m.decision_seconds.observe(elapsed)
        out = RouteDecision(
            decision,
            n_tokens,
            hashes,
            hash_size,
            scores,
            spec_blocks,
            candidates,
            index_ok,
            elapsed,
            affinity,
            (ids, salt, lora) if ids else None,
        )
        if record if predict is None else predict:
            self.routed(out, decision.instance)
        return out

    @staticmethod
    def _candidates(
        healthy: Sequence[Instance], urls: Sequence[str], scores: dict[str, Score]
    ) -> dict[str, Candidate]:
        """Each instance as the policy sees it: its hit and the router's load on it (every
        replica's, where replicas share it: ``router.prediction.shared``)."""
        out: dict[str, Candidate] = {}
        get = scores.get
        for inst, url in zip(healthy, urls, strict=True):
            gpu, cpu, full = get(url) or ZERO
            # Candidate's fields in order, without the NamedTuple's Python-level __new__.
            out[url] = _new(
                Candidate,
                (
                    url,
                    gpu,
                    cpu,
                    inst.inflight_requests + inst.peer_inflight_requests,
                    inst.inflight_prefill_tokens + inst.peer_inflight_prefill_tokens,
                    inst.running_requests + inst.peer_running_requests,
                    inst.engine_waiting,
                    full,
                ),
            )
        return out

    def routed(self, decision: RouteDecision, instance: str) -> None:
        """``decision`` is sent to ``instance``: the policy counts it, and predict-on-route."""
        self.policy.assigned(instance, decision.uncached(instance))
        self.prediction.record(decision, instance)

    def settled(self, decision: RouteDecision, instance: str) -> None:
        """The request ``decision`` sent to ``instance`` ended (or this try failed)."""
        self.prediction.settle(decision, instance)
