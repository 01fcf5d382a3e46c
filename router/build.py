"""One factory for the routing core: the server, the replay simulator and the benchmarks
build their ``Router`` here, so the rules that pair its parts live once (the
``prefix_full_only`` baseline is the cost policy with a full-attention-only scorer; the
index is wrapped in ``InstrumentedIndex`` so its lookup and apply times are exported)."""

from __future__ import annotations

import time
from collections.abc import Callable

from router.config import RouterSettings
from router.decision.decide import HealthyInstances, Router
from router.decision.layout import LayoutRegistry
from router.decision.policy import COST_POLICIES, Policy, make_policy
from router.decision.prompt_hashes import PromptHashes
from router.decision.score import Scorer
from router.decision.tokenize import RoutingTokenizer
from router.fleet.affinity import SessionAffinity
from router.index.base import BlockIndex
from router.index.instrumented import IndexMetrics, InstrumentedIndex
from router.metrics import RouterMetrics
from router.prediction.predict import PredictOnRoute
from router.prediction.pressure import EvictionTracker
from router.prediction.shared import SharedPredictions
from router.prediction.speculative import SpeculativeResidency

__all__ = ["build_router", "eviction_tracker", "instrument"]


def instrument(index: BlockIndex, metrics: RouterMetrics) -> BlockIndex:
    """``index`` with its metrics exported in the router's registry (idempotent)."""
    if isinstance(index, InstrumentedIndex):
        return index
    return InstrumentedIndex(index, IndexMetrics(metrics.registry))


def eviction_tracker(
    settings: RouterSettings, clock: Callable[[], float] | None = None
) -> EvictionTracker | None:
    """The memory-pressure tracker a cost policy reads (None: off, or a policy that reads
    no pressure)."""
    window_s = settings.eviction.window_s
    if window_s <= 0 or settings.policy not in COST_POLICIES:
        return None
    return EvictionTracker(window_s, clock or time.monotonic)


def build_router(
    settings: RouterSettings,
    *,
    index: BlockIndex,
    layouts: LayoutRegistry,
    registry: HealthyInstances,
    metrics: RouterMetrics | None = None,
    tokenizer: RoutingTokenizer | None = None,
    policy: Policy | None = None,
    evictions: EvictionTracker | None = None,
    clock: Callable[[], float] | None = None,
    affinity: SessionAffinity | None = None,
    full_only: bool | None = None,
    shared: Callable[[SpeculativeResidency], SharedPredictions | None] | None = None,
) -> Router:
    """The routing core from ``settings``. ``index`` should already be ``instrument``ed
    when ingest writes through it too; ``policy`` overrides ``settings.policy``'s (the
    simulator seeds its tie-breaking; it then passes the ``evictions`` its policy reads);
    ``clock`` drives speculative expiry (virtual time); ``affinity`` keeps sessions on
    their instance (applied after the policy's ranking); ``full_only`` overrides the
    scorer's group filter (default: the ``prefix_full_only`` baseline scores
    full-attention groups only). Ingest feeds ``router.prediction`` (its listener) every
    batch: the eviction tracker a cost policy reads is fed there."""
    metrics = metrics or RouterMetrics()
    index = instrument(index, metrics)
    speculative = (
        SpeculativeResidency(settings.speculative.ttl_s)
        if clock is None
        else SpeculativeResidency(settings.speculative.ttl_s, clock=clock)
    )
    if policy is None:
        evictions = evictions or eviction_tracker(settings, clock)
        policy = make_policy(
            settings.policy,
            temperature=settings.temperature,
            settings=settings.cost,
            roomy=evictions.roomy if evictions is not None else None,
        )
    prompt_hashes = PromptHashes(settings.hash_algo, settings.seed)
    return Router(
        registry=registry,
        scorer=Scorer(
            index,
            layouts,
            full_only=settings.policy == "prefix_full_only" if full_only is None else full_only,
        ),
        index=index,
        policy=policy,
        tokenizer=tokenizer or RoutingTokenizer(settings.tokenizer),
        prediction=PredictOnRoute(
            speculative,
            layouts,
            prompt_hashes,
            evictions,
            shared=shared(speculative) if shared is not None else None,
        ),
        prompt_hashes=prompt_hashes,
        metrics=metrics,
        block_size=settings.block_size,
        affinity=affinity,
    )
