"""The CPU offload tier: chunk slots, eviction policy, copies, and ``medium="CPU"`` events.

Stores follow vLLM's ``OffloadingConnector``: at the end of each engine step (and when a
request finishes) every newly computed, whole chunk of a request is offered per group;
chunks already offloaded are skipped, sliding-window chunks with a freed block are
skipped, and a Mamba chunk is stored only if the state at its end is a cached block
(only that block is copied, to the chunk's last row). Making room evicts idle chunks
through the policy and emits ``BlockRemoved`` at once; the ``BlockStored`` of a new chunk
waits until its copy is observed complete. GPU blocks still being read by a store are
protected by a pool hook: handing such a block out again first waits for the copy.

Events are self-describing by default (per-GPU-block hashes, parent, token ids, block
size, for every group; a Mamba chunk names only its state block, the way vLLM's GPU
events skip null blocks). ``self_describing=False`` emits vLLM's legacy placeholder: the
chunk's last hash, no tokens, ``block_size=0``. Removals fan out to the same hashes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from engine_adapter.block_pool import KVBlock
from engine_adapter.offload.lookup import OffloadKey, num_cpu_hit_tokens, touch_keys
from engine_adapter.offload.policies import Chunk, make_policy
from engine_adapter.offload.transfer import GroupCopy, TransferEngine
from engine_adapter.profiles import ModelProfile, allocate_cpu_kv
from engine_adapter.request import Request
from events.groups import MambaSpec
from events.structs import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["OffloadConfig", "OffloadManager"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """CPU tier settings (vLLM: ``kv_connector_extra_config`` of ``OffloadingConnector``)."""

    num_cpu_chunks: int
    blocks_per_chunk: int = 4
    policy: str = "lru"  # "lru" | "arc"
    self_describing: bool = True
    offload_prompt_only: bool = True
    pin_memory: bool | None = None  # default: only when CUDA is present


@dataclass(slots=True)
class _ChunkInfo:
    """What a chunk's events say, snapshotted while its request is alive."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    lora_name: str | None


@dataclass(slots=True)
class _Job:
    kind: str  # "store" | "load"
    keys: list[OffloadKey]
    src_blocks: list[KVBlock]


class OffloadManager:
    """CPU chunk slots for every group, filled from and loaded back into GPU blocks."""

    def __init__(
        self,
        config: OffloadConfig,
        profile: ModelProfile,
        gpu_kv: Sequence[torch.Tensor],
        *,
        enable_events: bool = True,
    ) -> None:
        if config.num_cpu_chunks <= 0 or config.blocks_per_chunk <= 0:
            raise ValueError("the CPU tier needs a positive chunk count and chunk size")
        self.config = config
        self.specs = profile.specs
        self.block_size = profile.block_size
        self.k = config.blocks_per_chunk
        self.tokens_per_chunk = self.k * self.block_size
        self._events: list[KVCacheEvent] = []
        self.enable_events = enable_events
        self.cpu_kv = allocate_cpu_kv(profile, config.num_cpu_chunks, self.k, config.pin_memory)
        self.policy = make_policy(config.policy, config.num_cpu_chunks)
        self.transfer = TransferEngine(gpu_kv, self.cpu_kv)
        self._free_slots = list(range(config.num_cpu_chunks - 1, -1, -1))
        self._info: dict[OffloadKey, _ChunkInfo] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_ids = 0
        self._pending_src: dict[KVBlock, int] = {}  # GPU block -> store job reading it
        self._mamba = [isinstance(spec, MambaSpec) for spec in self.specs]
        self._next_stored: dict[str, list[int]] = {}
        self.stats: Counter[str] = Counter()

    # ---- lookup ---------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """Drain this tier's ``medium="CPU"`` events (vLLM: the connector's ``take_events``)."""
        events, self._events = self._events, []
        return events

    def is_ready(self, key: OffloadKey) -> bool:
        chunk = self.policy.get(key)
        return chunk is not None and chunk.ref_cnt >= 0

    def lookup(self, request: Request, gpu_hit: int) -> int:
        """CPU extension of ``gpu_hit`` for ``request``; refreshes the prompt's recency."""
        self.policy.touch(touch_keys(self.specs, request, self.k))
        return num_cpu_hit_tokens(
            self.specs, request, gpu_hit, self.tokens_per_chunk, self.is_ready
        )

    def can_load(self, request: Request, indices: Sequence[Sequence[int]]) -> bool:
        """Whether every chunk holding these per-group block positions is readable."""
        hashes = request.block_hashes
        k = self.k
        return all(
            self.is_ready((hashes[(i // k + 1) * k - 1], g))
            for g, idx in enumerate(indices)
            for i in idx
        )

    # ---- load -----------------------------------------------------------------------

    def load(self, request: Request, fills: Sequence[Sequence[tuple[int, KVBlock]]]) -> int:
        """Copy the chunks behind ``fills[g] = [(block position, fresh block)]`` to GPU.

        Waits for the copy (the engine computes on these blocks next). Returns chunks read.
        """
        hashes = request.block_hashes
        k = self.k
        pinned: dict[OffloadKey, Chunk] = {}
        copies: list[GroupCopy] = []
        for g, pairs in enumerate(fills):
            gpu_rows: list[int] = []
            cpu_rows: list[int] = []
            for idx, block in pairs:
                key = (hashes[(idx // k + 1) * k - 1], g)
                chunk = pinned.get(key) or self.policy.get(key)
                if chunk is None or not chunk.is_ready:
                    raise LookupError(f"chunk {key!r} is not offloaded; look up again")
                if key not in pinned:
                    chunk.ref_cnt += 1  # not evictable while read
                    pinned[key] = chunk
                gpu_rows.append(block.block_id)
                cpu_rows.append(chunk.slot * k + idx % k)
            if gpu_rows:
                copies.append(GroupCopy(g, gpu_rows, cpu_rows))
        if not copies:
            return 0
        job = self._new_job(_Job("load", list(pinned), []))
        self.transfer.submit(job, "load", copies)
        self._complete(self.transfer.wait([job]))
        self.stats["loaded_chunks"] += len(pinned)
        return len(pinned)

    # ---- store ----------------------------------------------------------------------

    def store(self, request: Request, tables: Sequence[Sequence[KVBlock | None]]) -> int:
        """Offer ``request``'s newly computed whole chunks; returns chunks being stored."""
        rid = request.request_id
        k = self.k
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        if self.config.offload_prompt_only:
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        num_chunks = min(num_tokens // self.tokens_per_chunk, len(request.block_hashes) // k)
        next_stored = self._next_stored.setdefault(rid, [0] * len(tables))
        ends = list(next_stored)
        offers: list[tuple[OffloadKey, int, list[tuple[int, KVBlock]]]] = []
        hashes = request.block_hashes
        for g, table in enumerate(tables):
            end = min(num_chunks, len(table) // k)
            ends[g] = max(next_stored[g], end)
            mamba = self._mamba[g]
            for c in range(next_stored[g], end):
                lo = c * k
                if mamba:
                    last = table[lo + k - 1]
                    if last is None or last.key is None:
                        continue  # no state saved at this chunk's end
                    rows = [(k - 1, last)]
                else:
                    seg = table[lo : lo + k]
                    if None in seg:
                        continue  # a window block already freed: the chunk is incomplete
                    rows = list(enumerate(cast(list[KVBlock], seg)))
                offers.append(((hashes[lo + k - 1], g), c, rows))
        todo = [o for o in offers if self.policy.get(o[0]) is None]
        if not todo:
            next_stored[:] = ends
            return 0
        shortfall = len(todo) - len(self._free_slots)
        if shortfall > 0:
            victims = self.policy.evict(shortfall, {key for key, _, _ in offers})
            if victims is None:
                self.stats["store_failures"] += 1
                logger.debug("request %s: no idle CPU chunk to evict; retry next step", rid)
                return 0
            self._drop(victims)
        gpu_rows: list[list[int]] = [[] for _ in tables]
        cpu_rows: list[list[int]] = [[] for _ in tables]
        src: list[KVBlock] = []
        chunks: list[Chunk] = []
        for key, c, rows in todo:
            chunk = Chunk(self._free_slots.pop())
            chunks.append(chunk)
            self._info[key] = self._snapshot(request, key[1], c)
            base = chunk.slot * k
            gpu_rows[key[1]].extend(block.block_id for _, block in rows)
            cpu_rows[key[1]].extend(base + offset for offset, _ in rows)
            src.extend(block for _, block in rows)
        # Insert tail chunks first so a prefix's head ends up most recent: tails go first.
        for (key, _, _), chunk in zip(reversed(todo), reversed(chunks), strict=True):
            self.policy.insert(key, chunk)
        job = self._new_job(_Job("store", [key for key, _, _ in todo], src))
        pending = self._pending_src
        for block in src:
            pending[block] = job  # a block is read by at most one pending store
        copies = [GroupCopy(g, gpu_rows[g], cpu_rows[g]) for g in range(len(tables)) if gpu_rows[g]]
        self.transfer.submit(job, "store", copies)
        next_stored[:] = ends
        self.stats["stores_submitted"] += len(todo)
        return len(todo)

    def request_finished(self, request_id: str) -> None:
        self._next_stored.pop(request_id, None)

    def _snapshot(self, request: Request, g: int, c: int) -> _ChunkInfo:
        k, bs = self.k, self.block_size
        wires = request.wire_hashes
        lo, hi = c * k, (c + 1) * k
        if not self.config.self_describing:
            return _ChunkInfo([wires[hi - 1]], None, [], None)
        hashes = [wires[hi - 1]] if self._mamba[g] else wires[lo:hi]
        return _ChunkInfo(
            hashes,
            wires[lo - 1] if lo else None,
            request.all_token_ids[lo * bs : hi * bs],
            request.lora_name,
        )

    def _drop(self, victims: list[tuple[OffloadKey, Chunk]]) -> None:
        removed: dict[int, list[int]] = {}
        for key, chunk in victims:
            self._free_slots.append(chunk.slot)
            removed.setdefault(key[1], []).extend(self._info.pop(key).hashes)
        self.stats["evicted_chunks"] += len(victims)
        if self.enable_events:
            for g, hashes in removed.items():
                self._events.append(BlockRemoved(hashes, MEDIUM_CPU, g))

    # ---- completion -----------------------------------------------------------------

    def _new_job(self, job: _Job) -> int:
        self._job_ids += 1
        self._jobs[self._job_ids] = job
        return self._job_ids

    def _complete(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.pop(job_id)
            pending = self._pending_src
            for block in job.src_blocks:
                if pending.get(block) == job_id:
                    del pending[block]
            for key in job.keys:
                chunk = self.policy.get(key)
                if chunk is None:
                    continue
                if job.kind == "load":
                    chunk.ref_cnt -= 1
                elif chunk.ref_cnt == -1:
                    chunk.ref_cnt = 0  # readable and evictable from now on
                    self.stats["stored_chunks"] += 1
                    if self.enable_events:
                        self._events.append(self._stored_event(key))

    def _stored_event(self, key: OffloadKey) -> BlockStored:
        info = self._info[key]
        spec = self.specs[key[1]]
        return BlockStored(
            block_hashes=list(info.hashes),
            parent_block_hash=info.parent,
            token_ids=info.token_ids,
            block_size=self.block_size if self.config.self_describing else 0,
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=info.lora_name,
            extra_keys=None,
            group_idx=key[1],
            kv_cache_spec_kind=spec.kind,
            kv_cache_spec_sliding_window=spec.sliding_window,
        )

    def poll(self) -> None:
        """Publish the stores whose copies have finished."""
        self._complete(self.transfer.poll())

    def wait_all(self) -> None:
        self._complete(self.transfer.wait_all())

    def on_blocks_reused(self, blocks: list[KVBlock]) -> None:
        """Pool hook: finish stores still reading blocks that are about to be reused."""
        if not self._pending_src:
            return
        pending = self._pending_src
        jobs = {pending[b] for b in blocks if b in pending}
        if jobs:
            self.stats["store_flushes"] += 1
            self._complete(self.transfer.wait(sorted(jobs)))

    # ---- state ----------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every chunk without events (the caller emits ``AllBlocksCleared``)."""
        self.wait_all()
        self.policy.clear()
        self._info.clear()
        self._pending_src.clear()
        self._next_stored.clear()
        self._free_slots = list(range(self.config.num_cpu_chunks - 1, -1, -1))

    def residency(self) -> Counter[tuple[int, int]]:
        """``(group_idx, wire hash) -> readable chunks naming it`` (what events advertise)."""
        out: Counter[tuple[int, int]] = Counter()
        for key, chunk in self.policy.items():
            if chunk.is_ready:
                for h in self._info[key].hashes:
                    out[(key[1], h)] += 1
        return out

    @property
    def num_used_chunks(self) -> int:
        return len(self.policy)

    def close(self) -> None:
        self.wait_all()
        self.transfer.close()
