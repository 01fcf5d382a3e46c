"""From an OpenAI body to a ranked list of instances, with the reasons.

tokenize (the engine's tokenizer) -> block hashes (vLLM's, events.hashing) -> per instance
(gpu, cpu) hit from the index (router.score) and the speculative prefix of recently routed
requests -> the policy's ranking. If the index is unreachable the request is still routed,
on load alone, and the failure is counted.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from events.retention import retained_prompt_blocks
from router.affinity import SessionAffinity
from router.index.base import BlockIndex, Tier, group_tier
from router.instances import Instance, InstanceRegistry
from router.metrics import RouterMetrics
from router.policy import Candidate, Decision, Policy
from router.pressure import EvictionTracker
from router.prompt_hashes import PromptHashes
from router.score import ZERO, Score, Scorer
from router.speculative import Held, SpeculativeResidency
from router.tokenize import RoutingTokenizer

__all__ = ["RouteDecision", "Router"]

_new = tuple.__new__


def _busy(inst: Instance) -> int:
    """Requests the router has on ``inst``: remote tokenization goes to the least busy
    instance, not always the first (one API server tokenizing for the whole fleet)."""
    return inst.inflight_requests + inst.running_requests


log = logging.getLogger(__name__)


@dataclass
class RouteDecision:
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
    # instance -> what predict-on-route recorded there (released when the request ends)
    speculative_held: dict[str, Held] = field(default_factory=dict)
    # router.admission.Ticket: the slot admission gave it, released once a forward starts
    ticket: Any = None
    affinity: dict[str, Any] | None = None  # router.affinity's account, for /debug/route
    # router.gate's: the model's pool before the busy filter, and the LoRA adapter.
    pool: list[Any] = field(default_factory=list)
    lora: tuple[str, str | None] | None = None
    # What the hashes were made from (token ids, cache_salt, LoRA key), to hash again at
    # another block size when an instance's first events name its own (Router.relayout).
    hash_input: tuple[list[int], str | None, tuple[str, str | None] | None] | None = None

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

    registry: InstanceRegistry
    scorer: Scorer
    index: BlockIndex
    policy: Policy
    tokenizer: RoutingTokenizer
    speculative: SpeculativeResidency
    metrics: RouterMetrics
    block_size: int  # until an instance's events say otherwise
    hash_algo: str
    seed: str | None
    affinity: SessionAffinity | None = None
    # Fed by ingest with every event batch; the cost policy reads it (``router.pressure``).
    evictions: EvictionTracker | None = None
    prompt_hashes: PromptHashes = field(init=False)
    # instance -> id(decision) -> (decision, the layout its speculative entries assumed,
    # when they expire), in recording order, while the request is in flight: re-recorded
    # when the instance's layout changes. Expired ones are dropped as new ones come (a
    # decision that was never forwarded is never settled).
    _recorded: dict[str, dict[int, tuple[RouteDecision, Any, float]]] = field(
        init=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        self.prompt_hashes = PromptHashes(self.hash_algo, self.seed)

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
        in between either (``router.proxy``). ``instances``: the
        request's pool (``router.models``; default every healthy one); ``lora``: the
        adapter it names, ``(name, path)``, an extra key of every block as in vLLM;
        ``session``: its session key (``router.affinity``, applied after the ranking)."""
        t0 = time.perf_counter()
        healthy = list(instances) if instances is not None else self.registry.healthy()
        if not healthy:
            return None
        # remote: the least busy API server of the pool tokenizes
        at = min(healthy, key=_busy).http_url if self.tokenizer.remote else None
        ids = await self.tokenizer.prompt_ids(body, kind, at)
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
                hashes[size] = hs = self.prompt_hashes.wire_hashes(ids, size, salt, lora)
                t_score = time.perf_counter()
                m.stage_hash.observe(t_score - t_hash)
                if not hs:
                    continue
                extra = self.speculative.residency(hs, group)
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
        )
        out.affinity = affinity
        if ids:
            out.hash_input = (ids, salt, lora)
        if record if predict is None else predict:
            self.routed(out, decision.instance)
        return out

    @staticmethod
    def _candidates(
        healthy: Sequence[Instance], urls: Sequence[str], scores: dict[str, Score]
    ) -> dict[str, Candidate]:
        """Each instance as the policy sees it: its hit and the router's load on it."""
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
                    inst.inflight_requests,
                    inst.inflight_prefill_tokens,
                    inst.running_requests,
                    inst.engine_waiting,
                    full,
                ),
            )
        return out

    def routed(self, decision: RouteDecision, instance: str) -> None:
        """``decision`` is sent to ``instance``: the policy counts it, and predict-on-route."""
        self.policy.assigned(instance, decision.uncached(instance))
        self._predict(decision, instance)

    def _predict(self, decision: RouteDecision, instance: str) -> None:
        """Predict-on-route: the blocks the chosen instance will cache for this prompt,
        per group, as vLLM retains them (``events.retention``)."""
        hashes = decision.block_hashes(instance)
        layout = self.scorer.layouts.get(instance)
        if not hashes or layout is None or instance in decision.speculative_held:
            return
        if self.speculative.ttl_s <= 0:  # predict-on-route off: nothing to work out
            return
        score = decision.scores.get(instance)
        # Where the request resumes is where vLLM keeps a state for its siblings: the
        # junction, else its hit (whose state is there already). Scored under another
        # layout (relayout: the default, full attention alone), the hit is that junction.
        junction = (score.junction_tokens or score.gpu_tokens) if score else 0
        held = retained_prompt_blocks(
            layout.groups, decision.prompt_tokens, layout.hash_block_size, junction=junction
        )
        n, take = len(hashes), hashes.__getitem__
        per_group: dict[int, list[int]] = {}
        whole = 0  # groups holding every block from the first: a prefix of the prompt
        for g, positions in held:  # ascending positions; map + getitem runs in C
            if positions and positions[-1] >= n:
                positions = positions[: bisect_left(positions, n)]
            if positions and positions[-1] == len(positions) - 1:
                whole |= 1 << g
                per_group[g] = hashes[: len(positions)]
            else:
                per_group[g] = list(map(take, positions))
        handle = self.speculative.record(instance, per_group, whole)
        if handle is None:
            return
        decision.speculative_held[instance] = handle
        recorded = self._recorded.setdefault(instance, {})
        now = self.speculative.now()
        while recorded:
            oldest = next(iter(recorded))
            if recorded[oldest][2] > now:
                break
            del recorded[oldest]
        recorded[id(decision)] = (decision, layout, now + self.speculative.ttl_s)

    def settled(self, decision: RouteDecision, instance: str) -> None:
        """The routed request ended: its events are published; the index takes over at
        the next batch applied from ``instance``."""
        recorded = self._recorded.get(instance)
        if recorded:
            recorded.pop(id(decision), None)
        held = decision.speculative_held.pop(instance, None)
        if held:
            self.speculative.settle(instance, held)

    def relayout(self, instance: str) -> None:
        """``instance``'s layout changed (its first events taught its groups): what was
        predicted for its requests in flight assumed the old one -- before an engine's
        first events, the default (full attention alone), which put every block in group
        0 and none in a hybrid's other sliding-window or Mamba groups, so every next
        request scored no hit there and left; and the block size vLLM chose (128 for the
        tiny Gemma-3 on CPU) may not be the one configured. Record them again as the new
        layout retains them, hashed at its block size."""
        recorded = self._recorded.get(instance)
        layout = self.scorer.layouts.get(instance)
        if not recorded or layout is None:
            return
        size = layout.hash_block_size
        for decision, assumed, _ in list(recorded.values()):
            if assumed == layout:
                continue
            del recorded[id(decision)]
            held = decision.speculative_held.pop(instance, None)
            if held:
                self.speculative.release(instance, held)
            if size not in decision.hashes and decision.hash_input is not None:
                ids, salt, lora = decision.hash_input  # vLLM hashes at another block size
                decision.hashes[size] = self.prompt_hashes.wire_hashes(ids, size, salt, lora)
            decision.hash_size[instance] = size
            self._predict(decision, instance)

    async def explain(self, decision: RouteDecision) -> dict[str, Any]:
        """``/debug/route``: per instance hits per tier and group, queue terms, TTFT."""
        groups: dict[str, dict[str, Any]] = {}
        found: dict[str, Any] = {}
        if decision.index_ok:
            for size, hs in decision.hashes.items():
                urls = [u for u in decision.candidates if decision.hash_size.get(u) == size]
                try:
                    found.update(await self.index.lookup(hs, urls) if hs else {})
                except Exception:
                    found = {}
                    break
        layouts = self.scorer.layouts
        if found:
            for url, res in found.items():
                per: dict[str, Any] = {}
                lay = layouts.get(url)
                for slot, mask in sorted(res.items()):
                    g, tier = group_tier(slot)
                    part = {
                        "prefix_blocks": ((mask + 1) & ~mask).bit_length() - 1,
                        "resident_blocks": mask.bit_count(),
                    }
                    if tier is not Tier.GPU and lay is not None:
                        part["chunk_keys"] = _chunk_keys(mask, lay)
                    per[f"group{g}.{'gpu' if tier is Tier.GPU else 'cpu'}"] = part
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
            "policy": self.policy.name,
            "reason": decision.decision.reason,
            "prompt_tokens": decision.prompt_tokens,
            "num_blocks": {str(k): len(v) for k, v in decision.hashes.items()},
            "index_ok": decision.index_ok,
            "affinity": decision.affinity,
            "decision_ms": decision.elapsed_s * 1e3,
            "candidates": out,
        }


def _chunk_info(layout: Any, source: str) -> dict[str, Any] | None:
    """``/debug/route``: the CPU chunk the scorer reads an instance's CPU tier with."""
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
