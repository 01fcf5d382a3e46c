"""Routing policies: ``Candidate`` in, ``Decision`` out (``base``); the cost policy
(``cost``) and its TTFT fit (``fit``); the baselines and the factory (``baselines``)."""

from router.decision.policy.base import Breakdown, Candidate, CostRates, Decision, Policy
from router.decision.policy.baselines import (
    COST_POLICIES,
    POLICIES,
    LeastLoadedPolicy,
    RoundRobinPolicy,
    make_policy,
)
from router.decision.policy.cost import CostPolicy

__all__ = [
    "COST_POLICIES",
    "POLICIES",
    "Breakdown",
    "Candidate",
    "CostPolicy",
    "CostRates",
    "Decision",
    "LeastLoadedPolicy",
    "Policy",
    "RoundRobinPolicy",
    "make_policy",
]
