"""What ``/dashboard/state`` reports: one JSON-ready snapshot of a running router.

Everything comes from what the router already keeps: its instances (health, router-side
load, the engine's own counters read by the health probe), its Prometheus registry (request
outcomes, prediction exactness, ingest progress per instance), the block index (blocks per
group and tier, when the backend counts them cheaply) and the ring of recent decisions
kept by :class:`router.dashboard.Dashboard`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.index.base import group_tier

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from router.decision.decide import RouteDecision
    from router.state import RouterState

__all__ = ["Recorded", "Samples", "build_snapshot", "summarize_decision"]

TIERS = ("gpu", "cpu")


# A decision for a prompt this long or shorter is kept as decided (its token list and
# hash lists are small: at most ~3.7 MB over the ring's 50); a longer one is copied
# without the prompt and with its hashes packed.
KEEP_AS_IS_TOKENS = 2048


@dataclass(slots=True)
class Recorded:
    """One forwarded request's routing decision, as decided -- never a long prompt: ``of``
    keeps a copy of a decision over ``KEEP_AS_IS_TOKENS`` without the token ids (a
    240k-token prompt's list is ~9 MB) and with the block hashes packed as u64 (8 bytes a
    block instead of ~40), which ``explain`` needs to show the residency the index holds
    now. A shorter one is kept as it is: copying it would cost each request more (a few
    microseconds) than it saves."""

    id: int
    ts: float  # wall clock
    kind: str  # chat | completion
    decision: RouteDecision

    @classmethod
    def of(cls, id: int, ts: float, kind: str, decision: RouteDecision) -> Recorded:
        if decision.prompt_tokens <= KEEP_AS_IS_TOKENS:
            return cls(id, ts, kind, decision)
        kept = dataclasses.replace(
            decision,
            # Packed u64 arrays in place of the lists (read back as lists by ``explainable``).
            hashes={k: array("Q", v) for k, v in decision.hashes.items()},  # type: ignore[misc]
            hash_size=dict(decision.hash_size),
            hash_input=None,
        )
        return cls(id, ts, kind, kept)

    def explainable(self) -> RouteDecision:
        """The decision with its hashes as lists again (what ``Router.explain`` reads)."""
        if all(type(v) is list for v in self.decision.hashes.values()):
            return self.decision
        hashes = {k: list(v) for k, v in self.decision.hashes.items()}
        return dataclasses.replace(self.decision, hashes=hashes)


class Samples:
    """The samples of a Prometheus registry, read once: ``{name: [(labels, value)]}``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in registry.collect():
            for s in family.samples:
                self.by_name.setdefault(s.name, []).append((s.labels, s.value))

    def _match(self, name: str, match: dict[str, str]) -> Iterable[tuple[dict[str, str], float]]:
        for labels, value in self.by_name.get(name, ()):
            if all(labels.get(k) == v for k, v in match.items()):
                yield labels, value

    def total(self, name: str, **match: str) -> float:
        return sum(v for _, v in self._match(name, match))

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in self._match(name, match):
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
        return out

    def value(self, name: str, **match: str) -> float | None:
        found = [v for _, v in self._match(name, match)]
        return found[0] if found else None


def _num(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) or math.isinf(v) else v


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _ints(d: dict[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in sorted(d.items())}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def summarize_decision(rec: Recorded, policy: str, uses_scores: bool) -> dict[str, Any]:
    """The chosen instance, its predicted hit and TTFT breakdown, the runner-up and why."""
    d = rec.decision
    dec = d.decision
    chosen = dec.instance
    c = d.candidates.get(chosen)
    part = dec.breakdown.get(chosen)
    runner = next((u for u in dec.ranked if u != chosen), None)
    r = d.candidates.get(runner) if runner else None
    rpart = dec.breakdown.get(runner) if runner else None
    out: dict[str, Any] = {
        "id": rec.id,
        "ts": rec.ts,
        "kind": rec.kind,
        "instance": chosen,
        "prompt_tokens": d.prompt_tokens,
        "gpu_tokens": c.gpu_tokens if c else 0,
        "cpu_tokens": c.cpu_tokens if c else 0,
        "candidates": len(d.candidates),
        "index_ok": d.index_ok,
        "decision_ms": d.elapsed_s * 1e3,
        "predicted_ttft_ms": _ms(part.ttft_s) if part else None,
        "queue_ms": _ms(part.queue_s) if part else None,
        "prefill_ms": _ms(part.prefill_s) if part else None,
        "load_ms": _ms(part.load_s) if part else None,
        "runner_up": None,
    }
    if runner and r is not None:
        out["runner_up"] = {
            "instance": runner,
            "gpu_tokens": r.gpu_tokens,
            "cpu_tokens": r.cpu_tokens,
            "predicted_ttft_ms": _ms(rpart.ttft_s) if rpart else None,
            "queue_ms": _ms(rpart.queue_s) if rpart else None,
        }
    out["reason"] = _reason(d, policy, uses_scores, chosen, runner)
    return out


def _reason(
    d: RouteDecision, policy: str, uses_scores: bool, chosen: str, runner: str | None
) -> str:
    dec = d.decision
    if not uses_scores:
        return {
            "round_robin": "round robin: next in turn",
            "least_loaded": "least loaded: fewest in-flight tokens and requests",
        }.get(policy, f"{policy}: load only")
    if not d.index_ok:
        return "index unreachable: routed on load only"
    if runner is None:
        return "only healthy instance"
    c, r = d.candidates[chosen], d.candidates[runner]
    part, rpart = dec.breakdown.get(chosen), dec.breakdown.get(runner)
    hit_c, hit_r = c.gpu_tokens + c.cpu_tokens, r.gpu_tokens + r.cpu_tokens
    if part is None or rpart is None:
        return f"{policy}"
    if dec.reason == "sampled":
        return "sampled (temperature): not the lowest objective"
    # The ranking is by objective (prefill spent x load stretch), not by predicted TTFT: a
    # holder kept for its cache can predict a longer TTFT than the runner-up.
    dq = (part.queue_s - rpart.queue_s) * 1e3
    if hit_c > hit_r:
        tier = " (incl. CPU)" if c.cpu_tokens else ""
        text = f"prefix hit: {hit_c} cached tokens{tier} vs {hit_r} on the runner-up"
        return text + (f", despite a {dq:.0f} ms longer queue" if dq >= 0.5 else "")
    if hit_c < hit_r:
        return (
            f"load: the runner-up holds {hit_r - hit_c} more cached tokens, "
            f"but its queue is {-dq:.0f} ms longer"
        )
    if round(part.ttft_s, 9) == round(rpart.ttft_s, 9):
        return "tie: same hit and predicted TTFT; least load, then at random"
    if dq <= 0:
        return f"lower queue: {-dq:.0f} ms less than the runner-up (same hit)"
    return "lower load: fewer requests share its engine than the runner-up's (same hit)"


def _layout(state: RouterState, url: str) -> dict[str, Any]:
    layout = state.layouts.get(url)
    groups = []
    if layout is not None:
        for g in layout.groups:
            label = {"full_attention": "full", "sliding_window": "swa", "mamba": "mamba"}.get(
                g.kind, g.kind
            )
            if g.sliding_window:
                label += f" {g.sliding_window}"
            groups.append({"kind": g.kind, "label": label, "block_size": g.block_size})
    return {"groups": groups, "source": state.layouts.source(url)}


def _blocks(counts: dict[int, int] | None) -> list[dict[str, int | str]] | None:
    if counts is None:
        return None
    out: list[dict[str, int | str]] = []
    for slot, n in sorted(counts.items()):
        group, tier = group_tier(slot)
        out.append({"group": group, "tier": TIERS[tier], "blocks": n})
    return out


def _ingest(state: RouterState, m: Samples, url: str) -> dict[str, Any] | None:
    if url not in state.ingest.instances():
        return None
    events = m.by("kvroute_ingest_events_total", "type", instance=url, status="applied")
    batches = m.by("kvroute_ingest_batches_total", "source", instance=url)
    return {
        "last_seq": state.ingest.last_seq(url),
        "view": state.ingest.view(url),
        "batches_live": int(batches.get("live", 0)),
        "batches_replay": int(batches.get("replay", 0)),
        "events_applied": {k: int(v) for k, v in sorted(events.items())},
        "events_not_applied": int(
            m.total("kvroute_ingest_events_total", instance=url)
            - m.total("kvroute_ingest_events_total", instance=url, status="applied")
        ),
        "lag_ms": _ms(_num(m.value("kvroute_ingest_lag_seconds", instance=url))),
        **{
            key: int(m.total(f"kvroute_ingest_{key}_total", instance=url))
            for key in ("gaps", "missed_batches", "resyncs", "restarts", "undecodable", "errors")
        },
    }


async def _index_counts(state: RouterState) -> dict[str, dict[int, int]] | None:
    """Blocks per instance and slot from the index, when it counts them cheaply."""
    counts = getattr(state.index, "column_counts", None)
    if counts is None:
        return None
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            got: dict[str, dict[int, int]] = await counts()
            return got
    return None


async def build_snapshot(
    state: RouterState, decisions: list[Recorded], *, started: float
) -> dict[str, Any]:
    m = Samples(state.metrics.registry)
    counts = await _index_counts(state)
    loop_now = asyncio.get_running_loop().time()
    policy = state.policy
    instances = []
    fleet = {"prefix_queries": 0.0, "gpu_hits": 0.0, "cpu_hits": 0.0}
    cpu_known = False
    for inst in state.registry.all():
        url = inst.url
        eng = {k: _num(v) for k, v in inst.engine_stats.items()}
        queries = eng.get("prefix_queries")
        if queries is not None:
            fleet["prefix_queries"] += queries
            fleet["gpu_hits"] += eng.get("gpu_hits") or 0.0
            if eng.get("cpu_hits") is not None:
                cpu_known = True
                fleet["cpu_hits"] += eng["cpu_hits"] or 0.0
        ttft_n = m.total("kvroute_router_ttft_seconds_count", instance=url)
        instances.append(
            {
                "url": url,
                "healthy": inst.healthy,
                "down_for_s": None if inst.down_since is None else loop_now - inst.down_since,
                "served": inst.served,
                "errors": inst.errors,
                "inflight_requests": inst.inflight_requests,
                "inflight_prefill_tokens": inst.inflight_prefill_tokens,
                "running_requests": inst.running_requests,
                "engine_waiting": inst.engine_waiting,
                "engine": eng,
                "hit_ratio": {
                    "gpu": _ratio(eng.get("gpu_hits"), queries),
                    "cpu": _ratio(eng.get("cpu_hits"), queries),
                },
                "requests": _ints(m.by("kvroute_router_requests_total", "outcome", instance=url)),
                "ttft_mean_ms": _ms(
                    _ratio(m.total("kvroute_router_ttft_seconds_sum", instance=url), ttft_n)
                ),
                "layout": _layout(state, url),
                "blocks": _blocks(counts.get(url, {})) if counts is not None else None,
                "ingest": _ingest(state, m, url),
            }
        )
    predictions = m.by("kvroute_router_predictions_total", "result")
    dec_n = m.total("kvroute_router_decision_seconds_count")
    totals = {
        "requests": _ints(m.by("kvroute_router_requests_total", "outcome")),
        "retries": _ints(m.by("kvroute_router_retries_total", "reason")),
        "predictions": {k: int(predictions.get(k, 0)) for k in ("exact", "over", "under")},
        "predicted_tokens": {
            t: int(m.total("kvroute_router_predicted_hit_tokens_total", tier=t)) for t in TIERS
        },
        "reported_tokens": {
            t: int(m.total("kvroute_router_reported_hit_tokens_total", tier=t)) for t in TIERS
        },
        "index_errors": int(m.total("kvroute_router_index_errors_total")),
        "decisions": int(dec_n),
        "decision_mean_ms": _ms(_ratio(m.total("kvroute_router_decision_seconds_sum"), dec_n)),
        "engine_prefix_queries": int(fleet["prefix_queries"]),
        "hit_ratio": {
            "gpu": _ratio(fleet["gpu_hits"], fleet["prefix_queries"]),
            "cpu": _ratio(fleet["cpu_hits"], fleet["prefix_queries"]) if cpu_known else None,
        },
    }
    s = state.settings
    return {
        "version": 1,
        "generated_at": time.time(),
        "router": {
            "policy": policy.name,
            "index": "memory" if s.index in ("memory", "memory://") else s.index.split("://")[0],
            "uptime_s": time.time() - started,
            "instances": len(instances),
            "healthy": sum(1 for i in instances if i["healthy"]),
            "index_counts": counts is not None,
        },
        "totals": totals,
        "instances": instances,
        "decisions": [
            summarize_decision(rec, policy.name, policy.uses_scores) for rec in reversed(decisions)
        ],
    }
