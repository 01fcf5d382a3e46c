"""What every routing policy shares: ``Candidate`` in, ``Decision`` out, the ``Breakdown``
of predicted TTFT terms, the raw ``CostRates`` and the ``Policy`` interface. Kept apart from
the policies so those stay one module per concern; import them from
``router.decision.policy``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from router.config import CostSettings

__all__ = ["Breakdown", "Candidate", "CostRates", "Decision", "Policy"]


class Candidate(NamedTuple):
    """One healthy instance as the policy sees it. Immutable; a NamedTuple because a
    decision builds one per instance."""

    name: str
    gpu_tokens: int = 0  # predicted GPU prefix hit
    cpu_tokens: int = 0  # predicted extension loadable from the CPU tier
    inflight_requests: int = 0  # router-side: sent, first byte not yet back
    inflight_prefill_tokens: int = 0  # router-side: uncached tokens of those requests
    running_requests: int = 0  # router-side: streams not finished yet
    engine_waiting: int = 0  # engine-reported queue (from /metrics), when known
    # The longer GPU prefix full attention alone holds there, when a sliding-window or
    # Mamba group cut the hit short (``Score.junction_tokens``; 0: none): where the
    # conversation lives, though this request recomputes past ``gpu_tokens``.
    full_tokens: int = 0


# The policy's raw rates are fields of its settings, where their defaults live once.
CostRates = CostSettings


class Breakdown(NamedTuple):
    """Predicted TTFT terms for one candidate, in calibrated seconds (a NamedTuple, as
    ``Candidate``: one per instance per decision)."""

    queue_s: float
    prefill_s: float
    load_s: float
    decode_s: float = 0.0  # prefill steps stretched by the decode streams running
    fixed_s: float = 0.0  # fitted fixed term (HTTP, tokenization, scheduling)
    wait_s: float = 0.0  # fitted wait per request already there (admission, memory)
    raw_s: float = 0.0  # the uncalibrated work prediction the fit learns from
    requests: int = 0  # router requests on the instance at decision time (fit feature)
    objective_s: float | None = None  # TTFT + fleet terms: what the ranking minimises
    cached_tokens: int = 0
    credited_tokens: int = 0  # what the ranking credits (``CostPolicy.credited``)

    @property
    def ttft_s(self) -> float:
        return (
            self.queue_s + self.prefill_s + self.load_s + self.decode_s + self.fixed_s + self.wait_s
        )


@dataclass(frozen=True, slots=True)
class Decision:
    instance: str
    ranked: list[str]  # the chosen one first, then fallbacks for retries
    # Predicted TTFT terms per candidate (the cost policy's is lazy: ``_Breakdowns``).
    breakdown: Mapping[str, Breakdown] = field(default_factory=dict)
    reason: str = ""  # why the first one (cost policy): "min_cost", "sticky", ...


class Policy:
    name = "base"
    uses_scores = True

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        raise NotImplementedError

    def assigned(self, instance: str, uncached_tokens: int) -> None:
        """A request was routed to ``instance`` (only the cost policy counts it)."""

    def observe(self, instance: str, predicted: Breakdown | float, observed_ttft_s: float) -> None:
        """Feedback after a request's first byte (only the cost policy learns from it)."""
