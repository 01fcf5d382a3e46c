"""``KVCacheManager``: the engine's whole KV cache -- GPU pool, per-group managers, CPU tier.

What a (simulated) engine calls, per request and per step::

    req = kv.new_request("r1", prompt_ids)
    gpu, cpu = kv.lookup(req)                      # hit rule shared with the router
    if kv.allocate_slots(req, len(prompt_ids) - gpu - cpu or 1, gpu, cpu):
        ...                                       # CPU chunks are already loaded (real copy)
    req.append_output_token_ids(tok); kv.allocate_slots(req, 1)   # decode
    batch = kv.step_events()                       # end of step: one KVEventBatch or None
    kv.free(req)                                   # finished / preempted

The GPU hit is :func:`events.groups.longest_cache_hit` over "is block i of group g cached",
the CPU extension :func:`events.offload_hit.cpu_extension`; the router evaluates the same
functions over the residency the events describe. By default all groups share one block
pool (vLLM's hybrid allocator: window blocks freed early compete with full-attention
blocks for reuse); ``pool_per_group=True`` gives each group its own pool of
``num_gpu_blocks`` instead. Events of every tier go to one list in the order things
happened; ``step_events`` drains it into one batch per engine step.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

import torch

from engine_adapter.block_pool import BlockPool
from engine_adapter.managers import MambaManager, SingleTypeManager, make_manager
from engine_adapter.offload.manager import OffloadConfig, OffloadManager
from engine_adapter.profiles import ModelProfile, allocate_gpu_kv, default_device
from engine_adapter.request import Request
from events.groups import SlidingWindowSpec, cached_masks, hit_rule
from events.retention import cache_hit_alignment, reachable_boundaries
from events.structs import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = ["KVCacheManager"]

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Hybrid KV cache of one engine: allocation, prefix hits, offload, events."""

    def __init__(
        self,
        profile: ModelProfile,
        num_gpu_blocks: int,
        *,
        offload: OffloadConfig | None = None,
        device: torch.device | str | None = None,
        hash_algo: str = "sha256_cbor",
        hash_seed: str | None = None,
        pool_per_group: bool = False,
        enable_kv_cache_events: bool = True,
        allocate_kv: bool = True,
        max_model_len: int = 1 << 30,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        self.profile = profile
        self.specs = profile.specs
        self.block_size = profile.block_size
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed
        self._pending: list[KVCacheEvent] = []  # drained early, ahead of a reset's clear
        self._enable_events = enable_kv_cache_events
        n_groups = profile.num_groups
        if pool_per_group:
            self.pools = [self._new_pool(num_gpu_blocks) for _ in range(n_groups)]
        else:
            self.pools = [self._new_pool(num_gpu_blocks)] * n_groups
        self._unique_pools = list({id(p): p for p in self.pools}.values())
        self.max_model_len = max_model_len
        self.alignment = cache_hit_alignment(self.specs)  # vLLM's scheduler block size
        self.managers: list[SingleTypeManager] = [
            make_manager(
                spec,
                g,
                self.pools[g],
                alignment=self.alignment,
                enable_events=enable_kv_cache_events,
            )
            for g, spec in enumerate(self.specs)
        ]
        for m, spec in zip(self.managers, self.specs, strict=True):
            if isinstance(spec, SlidingWindowSpec):
                # vLLM's max_admission_blocks_per_request: the window plus one step's
                # tokens is all a request ever holds at once in this group.
                span = min(spec.sliding_window - 1 + max_num_batched_tokens, max_model_len)
                m.admission_cap = -(-span // spec.block_size) + 1
        self.device = torch.device(device) if device is not None else default_device()
        self.gpu_kv: list[torch.Tensor] = (
            allocate_gpu_kv(profile, num_gpu_blocks, self.device)
            if allocate_kv or offload is not None
            else []
        )
        self.offload: OffloadManager | None = None
        if offload is not None:
            self.offload = OffloadManager(
                offload, profile, self.gpu_kv, enable_events=enable_kv_cache_events
            )
            for pool in self._unique_pools:
                pool.reuse_hooks.append(self.offload.on_blocks_reused)
        self._scheduled: dict[str, Request] = {}

    def _new_pool(self, num_blocks: int) -> BlockPool:
        return BlockPool(num_blocks, enable_events=self._enable_events)

    # ---- requests and hits ----------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """A request hashed the way this engine's cache keys are (block size, algo, seed,
        extra keys)."""
        return Request(
            request_id,
            list(prompt_token_ids),
            block_size=self.block_size,
            hash_algo=self.hash_algo,
            hash_seed=self.hash_seed,
            lora_name=lora_name,
            lora_path=lora_path,
            cache_salt=cache_salt,
        )

    def is_cached_on_gpu(self, request: Request, group_idx: int, block_idx: int) -> bool:
        hashes = request.block_hashes
        return block_idx < len(hashes) and self.pools[group_idx].is_cached(
            (hashes[block_idx], group_idx)
        )

    def get_computed_blocks(self, request: Request) -> int:
        """GPU prefix-hit tokens (the last prompt token is always recomputed)."""
        hashes = request.block_hashes
        pools = self.pools

        def is_cached(g: int, i: int) -> bool:
            return i < len(hashes) and pools[g].is_cached((hashes[i], g))

        limit = request.num_tokens - 1
        if limit <= 0:
            request.shared_prefix_boundary = 0
            return 0
        masks = cached_masks(self.specs, is_cached, limit)
        hit, request.shared_prefix_boundary = hit_rule(self.specs).hit_and_junction(masks, limit)
        return hit

    def get_num_cpu_hit_tokens(self, request: Request, num_gpu_hit_tokens: int) -> int:
        """Tokens loadable from the CPU tier beyond the GPU hit (whole chunks)."""
        if self.offload is None:
            return 0
        return self.offload.lookup(request, num_gpu_hit_tokens)

    def lookup(self, request: Request) -> tuple[int, int]:
        """``(gpu_hit_tokens, cpu_hit_tokens)``; call right before the first allocation."""
        gpu = self.get_computed_blocks(request)
        return gpu, self.get_num_cpu_hit_tokens(request, gpu)

    # ---- allocation -----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_gpu_hit_tokens: int = 0,
        num_cpu_hit_tokens: int = 0,
        *,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        """Reserve blocks to compute ``num_new_tokens`` more tokens; False if they run out.

        vLLM's ``allocate_slots`` in order: (admission only) the whole sequence must fit;
        blocks no longer needed are freed first, even if the allocation then fails; the
        blocks needed are counted against the free queue (evictable cached blocks
        included); the first call adopts the hits from :meth:`lookup` and loads the CPU
        part into fresh blocks; new blocks are taken group by group; blocks that became
        full are cached as ``events.retention`` says. ``request.num_computed_tokens``
        then advances past the scheduled tokens.
        """
        rid = request.request_id
        first = rid not in self.managers[0].req_blocks
        hit = num_gpu_hit_tokens + num_cpu_hit_tokens
        if first:
            if request.num_computed_tokens:
                raise ValueError(f"{rid}: a new request must start with 0 computed tokens")
            if hit > request.num_tokens:
                raise ValueError(f"{rid}: hit of {hit} tokens exceeds {request.num_tokens}")
            if num_cpu_hit_tokens and self.offload is None:
                raise ValueError("CPU hits need an offload tier")
            total = min(hit, request.num_tokens - 1)
            hits = [m.hit_blocks(request, num_gpu_hit_tokens) for m in self.managers]
        else:
            if hit:
                raise ValueError(f"{rid}: prefix hits are only adopted by the first allocation")
            total = request.num_computed_tokens
            hits = [[] for _ in self.managers]
        end = total + num_new_tokens
        if num_new_tokens <= 0 and not (first and hit):
            raise ValueError(f"{rid}: nothing to schedule and no prefix hit to adopt")
        if end > request.num_tokens:
            raise ValueError(f"{rid}: cannot schedule up to {end} of {request.num_tokens} tokens")
        if full_sequence_must_fit and first:
            whole = min(request.num_tokens, self.max_model_len)
            need = [
                m.num_blocks_to_allocate(rid, whole, h, total, admission=True)
                for m, h in zip(self.managers, hits, strict=True)
            ]
            if not self._fits(need):
                return False
        for m in self.managers:
            m.remove_skipped(rid, total)
        need = [
            m.num_blocks_to_allocate(rid, end, h, total)
            for m, h in zip(self.managers, hits, strict=True)
        ]
        if not self._fits(need):
            return False
        if first:
            if num_cpu_hit_tokens:
                assert self.offload is not None
                ext = [
                    self._ext_positions(m, h, total)
                    for m, h in zip(self.managers, hits, strict=True)
                ]
                if not self.offload.can_load(request, ext):
                    raise LookupError(f"{rid}: CPU hit is stale; look up again")
            for m, h in zip(self.managers, hits, strict=True):
                m.adopt(rid, h, total)
            fills = [m.allocate_external(rid, total, num_cpu_hit_tokens) for m in self.managers]
            if num_cpu_hit_tokens:
                assert self.offload is not None
                self.offload.load(request, fills)
            request.num_gpu_hit_tokens = num_gpu_hit_tokens
            request.num_cpu_hit_tokens = num_cpu_hit_tokens
        for m in self.managers:
            m.allocate_new(rid, end)
        cacheable = min(end, request.num_tokens)
        cacheable -= cacheable % self.alignment
        boundaries = reachable_boundaries(request.num_prompt_tokens, request.shared_prefix_boundary)
        for m in self.managers:
            m.cache(request, cacheable, boundaries)
        request.num_computed_tokens = end
        self._scheduled[rid] = request
        return True

    def _fits(self, need: list[int]) -> bool:
        per_pool: dict[int, int] = {}
        for pool, n in zip(self.pools, need, strict=True):
            per_pool[id(pool)] = per_pool.get(id(pool), 0) + n
        return all(per_pool.get(id(p), 0) <= p.num_free_blocks for p in self._unique_pools)

    @staticmethod
    def _ext_positions(m: SingleTypeManager, hits: list, total: int) -> list[int]:
        """Positions a first allocation will load from the CPU tier (for the stale check)."""
        skipped = m.num_skipped_tokens(total) // m.block_size
        return list(range(max(skipped, len(hits)), -(-total // m.block_size)))

    def new_step_starts(self) -> None:
        """Start of an engine step: Mamba's same-step hit refusal starts afresh."""
        for m in self.managers:
            if isinstance(m, MambaManager):
                m.cached_this_step.clear()

    def free(self, request: Request) -> None:
        """Release a finished or preempted request (offering its last chunks to the CPU
        tier first). The caller resets ``num_computed_tokens`` to re-admit it."""
        rid = request.request_id
        if self.offload is not None and rid in self.managers[0].req_blocks:
            self.offload.store(request, [m.req_blocks[rid] for m in self.managers])
            self.offload.request_finished(rid)
        for m in self.managers:
            m.free(rid)
        self._scheduled.pop(rid, None)

    # ---- events and steps -----------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """Drain every pool's events, then the CPU tier's (vLLM's scheduler order: the KV
        cache manager's, then the connector's). Within a medium, in the order they happened."""
        events, self._pending = self._pending, []
        for pool in self._unique_pools:
            events += pool.take_events()
        if self.offload is not None:
            events += self.offload.take_events()
        return events

    def step_events(self, ts: float | None = None) -> KVEventBatch | None:
        """End of an engine step: offload newly computed chunks, publish finished copies,
        and return everything that happened as one batch (None if nothing did)."""
        if self.offload is not None:
            for rid, req in self._scheduled.items():
                self.offload.store(req, [m.req_blocks[rid] for m in self.managers])
            self.offload.poll()
        self._scheduled.clear()
        events = self.take_events()
        if not events:
            return None
        return KVEventBatch(ts=time.time() if ts is None else ts, events=events)

    def flush(self) -> None:
        """Wait for in-flight copies and queue their events (tests, shutdown)."""
        if self.offload is not None:
            self.offload.wait_all()

    def reset_prefix_cache(self, reset_external: bool = False) -> bool:
        """Forget the GPU tier's cached blocks (and with ``reset_external`` the CPU tier's
        too) if no request holds a block.

        vLLM's ``POST /reset_prefix_cache``: the block pool emits one ``AllBlocksCleared``
        (``BlockPool.reset_prefix_cache``); the offloading connector's tier is reset only
        with ``?reset_external=true`` (``Scheduler.reset_prefix_cache(reset_connector)``)
        and silently, so both cases send the same single event.
        """
        if not self.is_idle():
            logger.warning("reset_prefix_cache refused: blocks still in use")
            return False
        if self.offload is not None and reset_external:
            self.offload.reset()
        for pool in self._unique_pools:
            pool.reset(emit=False)
        if self._enable_events:
            # Whatever happened before the reset is published before its clear.
            self._pending = [*self.take_events(), AllBlocksCleared()]
        return True

    # ---- introspection --------------------------------------------------------------

    def get_block_ids(self, request: Request) -> list[list[int | None]]:
        """Per group, the request's block ids by position (None: not held)."""
        return [m.block_ids(request.request_id) for m in self.managers]

    def residency(self) -> Counter[tuple[int, int, str]]:
        """True contents: ``(group_idx, wire hash, medium) -> copies`` (GPU blocks caching
        it; readable CPU chunks naming it). What the events, applied in order, imply."""
        out: Counter[tuple[int, int, str]] = Counter()
        for pool in self._unique_pools:
            for (g, h), n in pool.residency().items():
                out[(g, h, MEDIUM_GPU)] += n
        if self.offload is not None:
            for (g, h), n in self.offload.residency().items():
                out[(g, h, MEDIUM_CPU)] += n
        return out

    @property
    def tokens_per_chunk(self) -> int:
        return self.offload.tokens_per_chunk if self.offload is not None else 0

    def is_idle(self) -> bool:
        """No request holds a block (every usable block is in the free queue)."""
        return all(p.num_free_blocks == p.num_usable for p in self._unique_pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self._unique_pools)

    @property
    def usage(self) -> float:
        return max(p.usage for p in self._unique_pools)

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
