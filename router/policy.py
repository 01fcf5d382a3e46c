"""Routing policies: pick an instance from per-instance hits and load.

``cost`` (default) predicts each candidate's time to first token and picks the minimum:

    TTFT = queue wait + prefill(uncached tokens) + load(CPU-hit tokens)
    queue wait = (in-flight prefill tokens * prefill rate) + waiting requests * per-request
                 overhead

Rates start from configured defaults and are calibrated online per instance from observed
TTFTs (an exponential moving average of observed / predicted). Ties are broken by the
least load, then at random -- never by list order, so idle cold traffic spreads out. An
optional softmax temperature samples instead of taking the minimum.

Baselines kept for benchmarks: ``round_robin``, ``least_loaded`` and ``prefix_full_only``
(the cost policy fed by a scorer that ignores sliding-window and Mamba groups: what peer
routers do today). Policies are pure (no I/O), so the simulator uses them unchanged.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "POLICIES",
    "Candidate",
    "CostPolicy",
    "CostRates",
    "Decision",
    "LeastLoadedPolicy",
    "Policy",
    "RoundRobinPolicy",
    "make_policy",
]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy instance as the policy sees it."""

    name: str
    gpu_tokens: int = 0  # predicted GPU prefix hit
    cpu_tokens: int = 0  # predicted extension loadable from the CPU tier
    inflight_requests: int = 0  # router-side: sent, first byte not yet back
    inflight_prefill_tokens: int = 0  # router-side: uncached tokens of those requests
    running_requests: int = 0  # router-side: streams not finished yet
    engine_waiting: int = 0  # engine-reported queue (from /metrics), when known


@dataclass(slots=True)
class CostRates:
    """Per-instance seconds per unit; calibrated online by ``CostPolicy.observe``."""

    prefill_s_per_token: float = 1e-4
    load_s_per_token: float = 7e-6
    request_overhead_s: float = 0.005
    calibration: float = 1.0  # EMA of observed / predicted TTFT


@dataclass(frozen=True, slots=True)
class Breakdown:
    queue_s: float
    prefill_s: float
    load_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s + self.load_s


@dataclass(frozen=True, slots=True)
class Decision:
    instance: str
    ranked: list[str]  # the chosen one first, then fallbacks for retries
    breakdown: dict[str, Breakdown] = field(default_factory=dict)


class Policy:
    name = "base"
    uses_scores = True

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        raise NotImplementedError

    def observe(self, instance: str, predicted_ttft_s: float, observed_ttft_s: float) -> None:
        """Feedback after a request's first byte (only the cost policy learns from it)."""


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


class CostPolicy(Policy):
    """Minimum predicted TTFT (see module docstring)."""

    name = "cost"

    def __init__(
        self,
        defaults: CostRates | None = None,
        *,
        temperature: float = 0.0,
        ema: float = 0.2,
        rng: random.Random | None = None,
    ) -> None:
        self.defaults = defaults or CostRates()
        self.temperature = temperature
        self.ema = ema
        self.rates: dict[str, CostRates] = {}
        self._rng = rng or random.Random()

    def _rates(self, name: str) -> CostRates:
        r = self.rates.get(name)
        if r is None:
            d = self.defaults
            r = self.rates[name] = CostRates(
                d.prefill_s_per_token, d.load_s_per_token, d.request_overhead_s
            )
        return r

    def breakdown(self, c: Candidate, num_prompt_tokens: int) -> Breakdown:
        r = self._rates(c.name)
        cached = min(c.gpu_tokens + c.cpu_tokens, num_prompt_tokens)
        uncached = max(num_prompt_tokens - cached, 1)  # the last token is always computed
        queue = (
            c.inflight_prefill_tokens * r.prefill_s_per_token
            + (c.inflight_requests + c.engine_waiting) * r.request_overhead_s
        )
        return Breakdown(
            queue_s=queue * r.calibration,
            prefill_s=uncached * r.prefill_s_per_token * r.calibration,
            load_s=c.cpu_tokens * r.load_s_per_token * r.calibration,
        )

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        parts = {c.name: self.breakdown(c, num_prompt_tokens) for c in candidates}
        shuffled = list(candidates)
        self._rng.shuffle(shuffled)
        ranked_c = sorted(shuffled, key=lambda c: (round(parts[c.name].ttft_s, 9), _load_key(c)))
        ranked = [c.name for c in ranked_c]
        if self.temperature > 0 and len(ranked) > 1:
            best = parts[ranked[0]].ttft_s
            weights = [math.exp(-(parts[n].ttft_s - best) / self.temperature) for n in ranked]
            pick = self._rng.choices(ranked, weights)[0]
            ranked.remove(pick)
            ranked.insert(0, pick)
        return Decision(ranked[0], ranked, parts)

    def observe(self, instance: str, predicted_ttft_s: float, observed_ttft_s: float) -> None:
        if predicted_ttft_s <= 0 or observed_ttft_s <= 0:
            return
        r = self._rates(instance)
        raw = predicted_ttft_s / r.calibration  # prediction before calibration
        ratio = min(max(observed_ttft_s / raw, 0.01), 100.0)
        r.calibration = (1 - self.ema) * r.calibration + self.ema * ratio


POLICIES = ("cost", "round_robin", "least_loaded", "prefix_full_only")


def make_policy(name: str, *, temperature: float = 0.0, rates: CostRates | None = None) -> Policy:
    """``prefix_full_only`` is the cost policy; the caller pairs it with a full-only scorer."""
    if name in ("cost", "prefix_full_only"):
        policy = CostPolicy(rates, temperature=temperature)
        policy.name = name
        return policy
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    raise ValueError(f"unknown policy {name!r}; expected one of {POLICIES}")
