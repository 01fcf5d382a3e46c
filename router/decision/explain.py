"""``/debug/route``: why a decision chose its instance -- per candidate the hit per group
and tier read from the index again (with the CPU chunk keys the request would hit), the
CPU chunk size the scorer reads the CPU tier with and where it came from, the load terms
and the predicted TTFT."""

from __future__ import annotations

from typing import Any

from router.decision.decide import RouteDecision, Router
from router.decision.score import Score
from router.index.base import Tier, group_tier

__all__ = ["explain"]


async def explain(router: Router, decision: RouteDecision) -> dict[str, Any]:
    """``/debug/route``: per instance hits per tier and group, queue terms, TTFT."""
    groups: dict[str, dict[str, Any]] = {}
    found: dict[str, Any] = {}
    if decision.index_ok:
        for size, hs in decision.hashes.items():
            urls = [u for u in decision.candidates if decision.hash_size.get(u) == size]
            try:
                found.update(await router.index.lookup(hs, urls) if hs else {})
            except Exception:
                found = {}
                break
    layouts = router.scorer.layouts
    if found:
        for url, res in found.items():
            per: dict[str, Any] = {}
            lay = layouts.get(url)
            for slot, mask in sorted(res.items()):
                g, tier = group_tier(slot)
                held: dict[str, int] = {
                    "prefix_blocks": ((mask + 1) & ~mask).bit_length() - 1,
                    "resident_blocks": mask.bit_count(),
                }
                if tier is not Tier.GPU and lay is not None:
                    held["chunk_keys"] = _chunk_keys(mask, lay)
                per[f"group{g}.{'gpu' if tier is Tier.GPU else 'cpu'}"] = held
            groups[url] = per
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
                "speculative_blocks": decision.speculative_blocks.get(url, 0),
                "hash_block_size": decision.hash_size.get(url),
                "layout_source": layouts.source(url),
                "cpu_chunk": _chunk_info(layout, layouts.chunk_source(url)),
                "groups": groups.get(url, {}),
                "layout": layout.to_dict() if layout else None,
                "inflight_requests": c.inflight_requests,
                "inflight_prefill_tokens": c.inflight_prefill_tokens,
                "running_requests": c.running_requests,
                "engine_waiting": c.engine_waiting,
                "queue_s": part.queue_s if part else None,
                "prefill_s": part.prefill_s if part else None,
                "load_s": part.load_s if part else None,
                "decode_s": part.decode_s if part else None,
                "fixed_s": part.fixed_s if part else None,
                "wait_s": part.wait_s if part else None,
                "predicted_ttft_s": part.ttft_s if part else None,
                "objective_s": part.objective_s if part else None,
            }
        )
    return {
        "instance": decision.decision.instance,
        "policy": router.policy.name,
        "reason": decision.decision.reason,
        "prompt_tokens": decision.prompt_tokens,
        "num_blocks": {str(k): len(v) for k, v in decision.hashes.items()},
        "index_ok": decision.index_ok,
        "affinity": decision.affinity,
        "decision_ms": decision.elapsed_s * 1e3,
        "candidates": out,
    }


def _chunk_info(layout: Any, source: str) -> dict[str, Any] | None:
    """The CPU chunk the scorer reads an instance's CPU tier with, and its source."""
    if layout is None:
        return None
    tpc = layout.tokens_per_chunk or layout.lcm_block_size
    return {
        "tokens_per_chunk": tpc,
        "blocks_per_chunk": tpc // layout.lcm_block_size,
        "source": source,
    }


def _chunk_keys(mask: int, layout: Any) -> int:
    """CPU chunks of the request resident (a chunk counts by its key, its last block)."""
    hbs = layout.hash_block_size
    stride = (layout.tokens_per_chunk or layout.lcm_block_size) // hbs
    if stride <= 1:
        return mask.bit_count()
    n, i = 0, stride - 1
    while mask >> i:
        n += (mask >> i) & 1
        i += stride
    return n
