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
from engine_adapter.managers import GroupPlan, SingleTypeManager, make_manager
from engine_adapter.offload.manager import OffloadConfig, OffloadManager
from engine_adapter.profiles import ModelProfile, allocate_gpu_kv, default_device
from engine_adapter.request import Request
from events.groups import longest_cache_hit
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
    ) -> None:
        self.profile = profile
        self.specs = profile.specs
        self.block_size = profile.block_size
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed
        self._events: list[KVCacheEvent] = []
        self._enable_events = enable_kv_cache_events
        n_groups = profile.num_groups
        if pool_per_group:
            self.pools = [self._new_pool(num_gpu_blocks) for _ in range(n_groups)]
        else:
            self.pools = [self._new_pool(num_gpu_blocks)] * n_groups
        self._unique_pools = list({id(p): p for p in self.pools}.values())
        self.managers: list[SingleTypeManager] = [
            make_manager(spec, g, self.pools[g], enable_events=enable_kv_cache_events)
            for g, spec in enumerate(self.specs)
        ]
        self.device = torch.device(device) if device is not None else default_device()
        self.gpu_kv: list[torch.Tensor] = (
            allocate_gpu_kv(profile, num_gpu_blocks, self.device)
            if allocate_kv or offload is not None
            else []
        )
        self.offload: OffloadManager | None = None
        if offload is not None:
            self.offload = OffloadManager(
                offload, profile, self.gpu_kv, self._events, enable_events=enable_kv_cache_events
            )
            for pool in self._unique_pools:
                pool.reuse_hooks.append(self.offload.on_blocks_reused)
        self._scheduled: dict[str, Request] = {}

    def _new_pool(self, num_blocks: int) -> BlockPool:
        return BlockPool(num_blocks, self._events, enable_events=self._enable_events)

    # ---- requests and hits ----------------------------------------------------------

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_path: str | None = None,
    ) -> Request:
        """A request hashed the way this engine's cache keys are (block size, algo, seed)."""
        return Request(
            request_id,
            list(prompt_token_ids),
            block_size=self.block_size,
            hash_algo=self.hash_algo,
            hash_seed=self.hash_seed,
            lora_name=lora_name,
            lora_path=lora_path,
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

        return longest_cache_hit(self.specs, is_cached, request.num_tokens - 1)

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
    ) -> bool:
        """Reserve blocks to compute ``num_new_tokens`` more tokens; False if they run out.

        The first call adopts the hits from :meth:`lookup` (made just before, with no
        other allocation in between) and loads the CPU part into fresh GPU blocks. If
        the hits cover the whole prompt the last token is still recomputed. On success
        the blocks that become full are cached (``BlockStored``) and
        ``request.num_computed_tokens`` advances past the scheduled tokens. On failure
        only out-of-window blocks may have been freed (silently, as vLLM does).
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
            start = min(hit, request.num_tokens - 1)
        else:
            if hit:
                raise ValueError(f"{rid}: prefix hits are only adopted by the first allocation")
            start = hit = request.num_computed_tokens
            for m in self.managers:
                m.remove_skipped(rid, start)
        end = start + num_new_tokens
        if num_new_tokens <= 0 and not (first and hit):
            raise ValueError(f"{rid}: nothing to schedule and no prefix hit to adopt")
        if end > request.num_tokens:
            raise ValueError(f"{rid}: cannot schedule up to {end} of {request.num_tokens} tokens")
        if first:
            plans = [m.plan_first(request, num_gpu_hit_tokens, hit, end) for m in self.managers]
        else:
            plans = [m.plan_running(rid, start, end) for m in self.managers]
        if not self._fits(plans):
            return False
        if first and num_cpu_hit_tokens:
            assert self.offload is not None
            if not self.offload.can_load(request, [p.ext for p in plans]):
                raise LookupError(f"{rid}: CPU hit is stale; look up again")
        if first:
            for m, p in zip(self.managers, plans, strict=True):
                m.adopt(rid, p)
            fills = [m.fill(p, p.ext) for m, p in zip(self.managers, plans, strict=True)]
            if num_cpu_hit_tokens:
                assert self.offload is not None
                self.offload.load(request, fills)
            request.num_gpu_hit_tokens = num_gpu_hit_tokens
            request.num_cpu_hit_tokens = num_cpu_hit_tokens
        for m, p in zip(self.managers, plans, strict=True):
            m.fill(p, p.new)
        num_to_cache = min(max(end, hit), request.num_tokens)
        for m in self.managers:
            m.cache(request, num_to_cache)
        request.num_computed_tokens = end
        self._scheduled[rid] = request
        return True

    def _fits(self, plans: list[GroupPlan]) -> bool:
        need: dict[int, int] = {}
        for pool, plan in zip(self.pools, plans, strict=True):
            need[id(pool)] = need.get(id(pool), 0) + plan.num_blocks_needed
        return all(need.get(id(p), 0) <= p.num_free_blocks for p in self._unique_pools)

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
        """Drain events of all tiers, in the order they happened."""
        events = list(self._events)
        self._events.clear()
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

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks, GPU and CPU, if no request holds a block.

        Emits one ``AllBlocksCleared``. vLLM clears its CPU tier silently; clearing both
        here keeps the tiers in step with what a consumer does on that event (forget
        everything of this engine).
        """
        if any(p.num_free_blocks != p.num_blocks for p in self._unique_pools):
            logger.warning("reset_prefix_cache refused: blocks still in use")
            return False
        if self.offload is not None:
            self.offload.reset()
        for pool in self._unique_pools:
            pool.reset(emit=False)
        if self._enable_events:
            self._events.append(AllBlocksCleared())
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

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self._unique_pools)

    @property
    def usage(self) -> float:
        return max(p.usage for p in self._unique_pools)

    def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
