"""Predict-on-route's one owner: record, settle, relayout, and what ingest tells it.

``record(decision, instance)`` credits the chosen instance, until the index knows, with
what vLLM will retain for the prompt (``events.retention``: every full-attention block,
the window tails / Mamba states at the junction and the prompt's end), kept in the
speculative store (``router.prediction.speculative``). ``settle`` hands a finished
request's entries over to the index at that instance's next applied batch
(``batch_applied``). A prediction made before an instance's first events assumed the
default layout; once the events teach another (``LayoutRegistry.version`` moves), the
requests still in flight there are recorded again as the new layout retains them, hashed
at its block size -- on the request path (the next read, record or settle), never inside
ingest's loop. The owner keeps the only per-request state (its ``_Entry``), so a
``RouteDecision`` is never written after it is made.

It is also ingest's listener (``router.ingest.IngestListener``): ``batch_learned`` ends
the credit of blocks the engine evicted from its GPU and feeds the eviction tracker the
cost policy reads (``router.prediction.pressure``).

With replicas on a Redis index, ``shared`` (``router.prediction.shared``) carries what this
owner records and settles to the other replicas and gives back theirs: ``residency`` ORs
them in, so a burst split across replicas sees where its first requests went.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from events.retention import retained_prompt_blocks
from events.structs import KVEventBatch
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.prompt_hashes import PromptHashes
from router.decision.score import Score
from router.index.base import Residency
from router.prediction.pressure import EvictionTracker
from router.prediction.shared import SharedPredictions, merge_residency
from router.prediction.speculative import Held, SpeculativeResidency

if TYPE_CHECKING:
    from router.decision.decide import RouteDecision

__all__ = ["PredictOnRoute", "retained_junction"]


def retained_junction(score: Score) -> int:
    """The shared-prefix junction whose sparse state (window tail, Mamba state) vLLM
    will keep for a request scored ``score`` there, else its GPU hit (whose state is
    there already: crediting it adds nothing).

    vLLM sets the junction from its GPU lookup alone (``KVCacheManager.get_computed_blocks``:
    the full-attention hit past the hybrid one, ``shared_prefix_boundary``), but a sparse
    group keeps a state only where the request computes one
    (``Scheduler._mamba_block_aligned_split`` stops a chunk at the junction only when
    ``start < junction < end``; ``SingleTypeKVCacheManager.reachable_block_mask`` keeps
    the blocks the request holds there). When its CPU tier loads past the junction
    (``OffloadingConnectorScheduler.get_num_new_matched_tokens``), the request resumes
    after it and holds no state there -- only at the loaded boundary, which is the
    junction itself when they coincide. Scored under another layout (relayout: the
    default, full attention alone) the GPU hit is that junction."""
    resume = score.gpu_tokens + score.cpu_tokens
    if score.junction_tokens and score.junction_tokens >= resume:
        return score.junction_tokens
    return score.gpu_tokens


@dataclass(slots=True, eq=False)
class _Entry:
    """One request's prediction on one instance while it is in flight."""

    decision: RouteDecision
    layout: InstanceLayout  # the layout the recorded blocks assume
    hashes: list[int]  # the prompt's wire hashes at that layout's block size
    handle: Held
    expiry: float


class PredictOnRoute:
    """Speculative residency per instance, and the requests it was recorded for."""

    def __init__(
        self,
        store: SpeculativeResidency,
        layouts: LayoutRegistry,
        prompt_hashes: PromptHashes,
        evictions: EvictionTracker | None = None,
        shared: SharedPredictions | None = None,
    ) -> None:
        self.store = store
        self.layouts = layouts
        self.prompt_hashes = prompt_hashes
        self.evictions = evictions  # fed per batch; the cost policy reads it (None: off)
        # instance -> id(decision) -> entry, in recording order (hence expiry order: one
        # TTL). An entry never settled (a decision never forwarded) is dropped once it
        # expired, when the next one is recorded there.
        self._inflight: dict[str, dict[int, _Entry]] = {}
        self._version = layouts.version
        # The other replicas' records and this one's, shared (None: one replica).
        self.shared = shared

    @property
    def ttl_s(self) -> float:
        return self.store.ttl_s

    # ---- the request path ---------------------------------------------------------

    def residency(self, hashes: Sequence[int], instances: Iterable[str]) -> dict[str, Residency]:
        """Per instance, the GPU-slot bitmasks predicted over ``hashes``' positions."""
        if self.layouts.version != self._version:
            self.relayout()
        if self.shared is None:
            return self.store.residency(hashes, instances)
        instances = list(instances)
        own = self.store.residency(hashes, instances)
        return merge_residency(own, self.shared.residency(hashes, instances))

    def record(self, decision: RouteDecision, instance: str) -> None:
        """``decision`` was sent to ``instance``: credit what vLLM will retain there."""
        if self.layouts.version != self._version:
            self.relayout()
        inflight = self._inflight.get(instance)
        if inflight is not None and id(decision) in inflight:
            return
        layout = self.layouts.get(instance)
        if layout is None or self.store.ttl_s <= 0:  # predict-on-route off
            return
        size = layout.hash_block_size
        if decision.hash_size.get(instance, size) == size:
            hashes = decision.block_hashes(instance)
        else:  # the instance's layout changed since the decision
            hashes = decision.hashes.get(size) or self._rehash(decision, size)
        self._record(decision, instance, layout, hashes)

    def _rehash(self, decision: RouteDecision, size: int) -> list[int]:
        if decision.hash_input is None:
            return []
        ids, salt, lora = decision.hash_input
        return self.prompt_hashes.wire_hashes(ids, size, salt, lora)

    def settle(self, decision: RouteDecision, instance: str) -> None:
        """The routed request ended: its events are published; the index takes over at
        the next batch applied from ``instance``."""
        if self.layouts.version != self._version:
            self.relayout()
        inflight = self._inflight.get(instance)
        entry = inflight.pop(id(decision), None) if inflight else None
        if entry is not None:
            self.store.settle(instance, entry.handle)
            if self.shared is not None:
                self.shared.settle(instance, id(decision))

    def relayout(self) -> None:
        """Layouts changed (an instance's first events taught its groups): what was
        predicted for its requests in flight assumed the old one -- before an engine's
        first events, the default (full attention alone), which put every block in group
        0 and none in a hybrid's sliding-window or Mamba groups, so every next request
        scored no hit there and left; and the block size vLLM chose (128 for the tiny
        Gemma-3 on CPU) may not be the one configured. Record them again as the new
        layout retains them, hashed at its block size."""
        self._version = self.layouts.version
        for instance, inflight in self._inflight.items():
            layout = self.layouts.get(instance)
            if not inflight or layout is None:
                continue
            size = layout.hash_block_size
            for key, entry in list(inflight.items()):
                if entry.layout == layout:
                    continue
                del inflight[key]
                self.store.release(instance, entry.handle)
                d, old = entry.decision, entry.layout
                hashes = entry.hashes if old.hash_block_size == size else d.hashes.get(size)
                if hashes is None:  # vLLM hashes at another block size
                    hashes = self._rehash(d, size)
                self._record(d, instance, layout, hashes)

    def _record(
        self,
        decision: RouteDecision,
        instance: str,
        layout: InstanceLayout,
        hashes: list[int],
    ) -> None:
        if not hashes:
            return
        score = decision.scores.get(instance)
        junction = retained_junction(score) if score else 0
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
        handle = self.store.record(instance, per_group, whole)
        if handle is None:
            return
        inflight = self._inflight.setdefault(instance, {})
        now = self.store.now()
        while inflight:
            oldest = next(iter(inflight))
            if inflight[oldest].expiry > now:
                break
            del inflight[oldest]
        inflight[id(decision)] = _Entry(decision, layout, hashes, handle, now + self.store.ttl_s)
        if self.shared is not None:  # recorded again (relayout): replaces it there too
            self.shared.record(instance, id(decision), per_group, whole)

    def forget(self, instance: str) -> None:
        """The instance is gone or down: drop what was predicted on it."""
        self._inflight.pop(instance, None)
        self.store.forget(instance)
        if self.shared is not None:
            self.shared.forget(instance)

    def inflight(self, instance: str) -> int:
        """Requests in flight on ``instance`` with a prediction recorded."""
        return len(self._inflight.get(instance, ()))

    # ---- router.ingest.IngestListener -------------------------------------------------

    def batch_learned(self, instance: str, batch: KVEventBatch) -> None:
        """A batch of ``instance``'s events is about to be applied: a GPU ``BlockRemoved``
        ends the speculative credit of that block in that group (``observe``), then the
        eviction tracker marks memory pressure."""
        self.store.observe(instance, batch)
        if self.evictions is not None:
            self.evictions.observe(instance, batch)

    def batch_applied(self, instance: str) -> None:
        """``instance``'s batches were applied: settled predictions give way to the index."""
        self.store.flush(instance)
        if self.shared is not None:  # the shared index has it: the others' give way too
            self.shared.applied(instance)
