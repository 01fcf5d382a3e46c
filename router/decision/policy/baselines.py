"""Baseline policies kept for benchmarks (``round_robin``, ``least_loaded``; the third,
``prefix_full_only``, is the cost policy over a full-attention-only scorer) and the one
factory that names every policy."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence

from router.config import POLICIES, CostSettings
from router.decision.policy.base import Candidate, Decision, Policy
from router.decision.policy.cost import CostPolicy

__all__ = ["COST_POLICIES", "POLICIES", "LeastLoadedPolicy", "RoundRobinPolicy", "make_policy"]


def _load_key(c: Candidate) -> tuple[int, int, int]:
    return (c.inflight_prefill_tokens, c.inflight_requests + c.engine_waiting, c.running_requests)


class RoundRobinPolicy(Policy):
    name = "round_robin"
    uses_scores = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        names = sorted(c.name for c in candidates)
        start = next(self._counter) % len(names)
        ranked = names[start:] + names[:start]
        return Decision(ranked[0], ranked)


class LeastLoadedPolicy(Policy):
    name = "least_loaded"
    uses_scores = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        shuffled = list(candidates)
        self._rng.shuffle(shuffled)  # equal load: random, not list order
        ranked = [c.name for c in sorted(shuffled, key=_load_key)]
        return Decision(ranked[0], ranked)


COST_POLICIES = ("cost", "prefix_full_only")  # the cost policy (and its scorer-side baseline)


def make_policy(
    name: str,
    *,
    temperature: float = 0.0,
    settings: CostSettings | None = None,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    roomy: Callable[[str], bool] | None = None,
) -> Policy:
    """``prefix_full_only`` is the cost policy (``settings``: its rates and knobs); the
    caller pairs it with a full-only scorer.
    ``roomy``: which instances have KV room (``EvictionTracker.roomy``), cost policy only."""
    if name in COST_POLICIES:
        return CostPolicy(
            settings, temperature=temperature, clock=clock, rng=rng, roomy=roomy, name=name
        )
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
