"""The CPU offload tier: chunk slots, eviction policy, copies, and ``medium="CPU"`` events.

It behaves as vLLM's ``OffloadingConnector`` with ``CPUOffloadingSpec`` does, 0.32's or
0.33's (``OffloadConfig.vllm_version``; 0.32 checked against the real connector in
``tests/vllm/test_offload_differential.py``, both against the connector's scheduler side
in process in ``tests/vllm/test_offload_inprocess.py``); each rule names the vLLM function
it follows (``offloading/scheduler.py`` unless said otherwise). What 0.33 changes
(docs/vllm-0.32-vs-0.33.md rows 16-22):

* LRU ranks per request (``policies.RankedLRUPolicy``), first accesses reported to the
  policy (``_seen``);
* a chunk with a reachable null block is not offered (``store``; 0.32 offers it when its
  last block is not null);
* self-describing placeholders name their group's kind and window (``_stored_event``);
* a request looked up at token 0 (preempted, restarting) offers every chunk again
  (``lookup``; 0.32 keeps its store progress);
* a reset waits for the copies in flight before the tier is reused (a fence): timing
  only, the same chunks are cached after it, so not modelled.

* **What is offered** (``_build_store_jobs``): at the end of every step, for every request
  scheduled in it, the whole chunks its computed tokens cover (``storable_chunks``; prompt
  tokens only, ``offload_prompt_only``), from the request's next unstored chunk on. A
  chunk is offered when its last GPU block is not null and, for a sliding-window group, one
  of its blocks is reachable (``_reachable_store_block_mask`` ->
  ``SlidingWindowManager.reachable_block_mask`` with ``prefix_cache_retention_interval``
  0: the window before the replay boundary ``num_prompt_tokens - 1`` and before the
  shared-prefix junction, each floored to the full-attention chunk). A Mamba group offers
  the state blocks the GPU tier cached in that step whose end is a chunk end
  (``_build_aligned_boundary_store_jobs``, one key per offer, before the others). A
  finished request's last chunks are offered at the next step's end, then its accesses
  re-rank the policy (``CPUOffloadingManager.on_request_finished``).
* **Where storing starts**: chunk 0, so chunks of a GPU hit are offered again (present
  ones count as reused); after a CPU load, the chunk after the loaded prefix
  (``update_state_after_alloc``).
* **Storing** (``CPUOffloadingManager.prepare_store``): keys already present are skipped;
  room is made by evicting idle chunks through the policy (never the offered keys), all or
  nothing -- on failure nothing is stored and the same chunks are offered next step; a
  ``BlockRemoved`` per group at once. A new chunk is readable when its copy completes: the
  step after the one that offered it (vLLM's worker submits a store at the next step's
  start), ``copy_delay_steps`` later still if asked; its ``BlockStored`` then.
* **Lookup** (``_lookup_complete_chunks``): a pure read (no recency change); chunks still
  being written count as present, but a request whose hit needs one waits
  (:meth:`OffloadManager.must_wait`).
* **Events** (``OffloadingEventsTracker``): placeholders by default -- the chunk's last
  hash, no parent, no tokens, ``block_size`` 0, no kind; with ``self_describing`` the
  full-attention chunks name every block hash, parent, tokens, block size and kind, and
  window / Mamba groups keep the placeholder. A removal names what the store named.
* **Reset**: only on request (``reset_cache``), without events.

Not modelled: Mamba states at hash boundaries inside a block (partial tails),
``store_threshold``, per-request ``kv_transfer_params``, asynchronous loads (a load is
waited for at once), adapter ids on events.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from engine_adapter.block_pool import KVBlock
from engine_adapter.offload.lookup import OffloadKey, hit_chunk_keys, num_cpu_hit_tokens
from engine_adapter.offload.policies import Chunk, make_policy
from engine_adapter.offload.transfer import GroupCopy, TransferEngine
from engine_adapter.profiles import ModelProfile, allocate_cpu_kv
from engine_adapter.request import Request
from events.groups import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from events.structs import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["VLLM_VERSIONS", "OffloadConfig", "OffloadManager"]

VLLM_VERSIONS = ("0.32", "0.33")

logger = logging.getLogger(__name__)

Table = Sequence[KVBlock | None]


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """CPU tier settings; names and defaults are vLLM's ``kv_connector_extra_config``
    keys of ``OffloadingConnector`` (``blocks_per_chunk`` 1, ``eviction_policy`` lru,
    ``self_describing_kv_events`` false, ``offload_prompt_only`` true).

    ``vllm_version``: whose connector to follow, "0.33" (what GPU fleets run) or "0.32"
    (the CPU build the conformance suite runs); docs/vllm-0.32-vs-0.33.md rows 16-22."""

    num_cpu_chunks: int
    blocks_per_chunk: int = 1
    policy: str = "lru"  # "lru" | "arc"
    self_describing: bool = False
    offload_prompt_only: bool = True
    pin_memory: bool | None = None  # default: only when CUDA is present
    copy_delay_steps: int = 0  # extra steps a store stays in flight (tests)
    vllm_version: str = "0.33"  # "0.32" | "0.33"

    def __post_init__(self) -> None:
        if self.vllm_version not in VLLM_VERSIONS:
            raise ValueError(f"vllm_version {self.vllm_version!r}: expected one of {VLLM_VERSIONS}")

    @property
    def v033(self) -> bool:
        return self.vllm_version == "0.33"


@dataclass(slots=True)
class _ChunkInfo:
    """What a chunk's events say, snapshotted while its request is alive."""

    hashes: list[int]
    parent: int | None
    token_ids: list[int]
    lora_name: str | None
    described: bool


@dataclass(slots=True)
class _Job:
    kind: str  # "store" | "load"
    keys: list[OffloadKey]
    src_blocks: list[KVBlock]
    due_step: int = 0


@dataclass(slots=True)
class _ReqState:
    """vLLM's ``RequestOffloadState`` + the manager's ``_RequestCacheAccess``."""

    next_stored: list[int]
    keys_seen: dict[OffloadKey, int] = field(default_factory=dict)  # key -> end token
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    lru_rank: int | None = None  # 0.33's LRU: the request's provisional rank


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
        self.policy = make_policy(config.policy, config.num_cpu_chunks, config.vllm_version)
        self.transfer = TransferEngine(gpu_kv, self.cpu_kv)
        self._free_slots = list(range(config.num_cpu_chunks - 1, -1, -1))
        self._info: dict[OffloadKey, _ChunkInfo] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_ids = 0
        self._step = 0
        self._pending_src: dict[KVBlock, int] = {}  # GPU block -> store job reading it
        self._mamba = [isinstance(spec, MambaSpec) for spec in self.specs]
        self._full = [isinstance(spec, FullAttentionSpec) for spec in self.specs]
        self._reqs: dict[str, _ReqState] = {}
        # Finished requests, offered at the end of the step after they finished.
        self._finishing: list[tuple[Request, list[list[KVBlock | None]]]] = []
        self._finished: list[tuple[Request, list[list[KVBlock | None]]]] = []
        # vLLM's SchedulerOffloadConfig.alignment_tokens: the full-attention chunk (the
        # largest chunk for models without full attention).
        self.alignment_tokens = self.tokens_per_chunk
        self.stats: Counter[str] = Counter()
        # 0.33's OffloadingEventsTracker: with self-describing events on, placeholders
        # (window / Mamba groups) carry their group's kind and window too; 0.32: None.
        self._classify = config.self_describing and config.v033

    # ---- lookup ---------------------------------------------------------------------

    def take_events(self) -> list[KVCacheEvent]:
        """Drain this tier's ``medium="CPU"`` events (vLLM: the connector's ``take_events``)."""
        events, self._events = self._events, []
        return events

    def is_ready(self, key: OffloadKey) -> bool:
        chunk = self.policy.get(key)
        return chunk is not None and chunk.ref_cnt >= 0

    def is_present(self, key: OffloadKey) -> bool:
        return self.policy.get(key) is not None

    def lookup(self, request: Request, gpu_hit: int) -> int:
        """CPU extension of ``gpu_hit`` for ``request`` (chunks being written included).

        A pure read, as ``CPUOffloadingManager.lookup``: recency changes only when the
        request finishes. 0.33 (``get_num_new_matched_tokens``): a request looked up at
        token 0 -- new, or preempted and restarting -- offers every chunk again."""
        if self.config.v033 and not request.num_computed_tokens:
            state = self._reqs.get(request.request_id)
            if state is not None:
                state.next_stored = [0] * len(self.specs)
        return num_cpu_hit_tokens(
            self.specs, request, gpu_hit, self.tokens_per_chunk, self.is_present
        )

    def must_wait(self, request: Request, gpu_hit: int, cpu_hit: int) -> bool:
        """Whether a chunk this hit reads is still being written: vLLM then defers the
        request (``get_num_new_matched_tokens`` returns None) and asks again next step."""
        if not cpu_hit:
            return False
        keys = hit_chunk_keys(self.specs, request, self.k, gpu_hit, gpu_hit + cpu_hit)
        return any(not self.is_ready(key) for key in keys)

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

    def load(
        self,
        request: Request,
        fills: Sequence[Sequence[tuple[int, KVBlock]]],
        num_cached_tokens: int,
    ) -> int:
        """Copy the chunks behind ``fills[g] = [(block position, fresh block)]`` to GPU.

        Waits for the copy (the engine computes on these blocks next). The request's
        stores then start after the loaded prefix (``update_state_after_alloc``).
        Returns chunks read.
        """
        hashes = request.block_hashes
        k = self.k
        pinned: dict[OffloadKey, Chunk] = {}
        chunk_of: dict[OffloadKey, int] = {}
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
                    chunk_of[key] = idx // k
                gpu_rows.append(block.block_id)
                cpu_rows.append(chunk.slot * k + idx % k)
            if gpu_rows:
                copies.append(GroupCopy(g, gpu_rows, cpu_rows))
        state = self._state(request)
        state.next_stored = [-(-num_cached_tokens // self.tokens_per_chunk)] * len(self.specs)
        if not copies:
            return 0
        tpc = self.tokens_per_chunk
        self._seen(state, [(key, (chunk_of[key] + 1) * tpc) for key in pinned])
        state.reused.update(key for key in pinned if key not in state.inserted)
        job = self._new_job(_Job("load", list(pinned), []))
        self.transfer.submit(job, "load", copies)
        self._complete(self.transfer.wait([job]))
        self.stats["loaded_chunks"] += len(pinned)
        return len(pinned)

    # ---- store ----------------------------------------------------------------------

    def _state(self, request: Request) -> _ReqState:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _ReqState([0] * len(self.specs))
        return state

    def _seen(self, state: _ReqState, keys: Sequence[tuple[OffloadKey, int]]) -> None:
        """Record accessed keys with their end token (vLLM's offload key position); the
        first access of each is reported to the policy (0.33's ``on_request_access``)."""
        new = []
        for key, end in keys:
            if key not in state.keys_seen:
                state.keys_seen[key] = end
                new.append(key)
        if new:
            self.policy.on_request_access(new, state)

    def _reachable(
        self, request: Request, g: int, lo_chunk: int, hi_chunk: int
    ) -> list[bool] | None:
        """Per block of the chunks ``[lo_chunk, hi_chunk)``: does it serve a hit? None:
        every block (full attention, Mamba); sliding window: vLLM's reachable mask
        (``reachable_block_mask``) at retention 0."""
        spec = self.specs[g]
        if not isinstance(spec, SlidingWindowSpec):
            return None
        bs, k = spec.block_size, self.k
        if self.alignment_tokens % bs:
            return None
        need = spec.window_blocks
        keep: set[int] = set()
        boundaries = [request.num_prompt_tokens - 1]
        if request.shared_prefix_boundary:
            boundaries.append(request.shared_prefix_boundary)
        for b in boundaries:
            end = b // self.alignment_tokens * self.alignment_tokens // bs
            keep.update(range(max(0, end - need), end))
        return [b in keep for b in range(lo_chunk * k, hi_chunk * k)]

    def store(
        self,
        request: Request,
        tables: Sequence[Table],
        num_tokens: int,
        new_state_blocks: Sequence[Sequence[int]] = (),
    ) -> int:
        """Offer ``request``'s whole chunks up to ``num_tokens`` computed tokens (vLLM's
        ``_build_store_jobs``); ``new_state_blocks[g]``: Mamba state blocks the GPU tier
        cached this step. Returns chunks being stored."""
        k = self.k
        tpc = self.tokens_per_chunk
        num_tokens = min(num_tokens, request.num_tokens)
        if self.config.offload_prompt_only:
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        hashes = request.block_hashes
        state = self._state(request)
        stored = 0
        # Mamba: one offer per state block cached this step ending on a chunk end.
        for g, positions in enumerate(new_state_blocks):
            if not self._mamba[g]:
                continue
            for i in positions:
                block = tables[g][i] if i < len(tables[g]) else None
                if block is None or (i + 1) % k or (i + 1) * self.block_size > num_tokens:
                    continue
                key = (hashes[i], g)
                rows = [(k - 1, block)]
                stored += self._prepare_store(request, state, [(key, i // k, rows)], [key])
        offers: list[tuple[OffloadKey, int, list[tuple[int, KVBlock]]]] = []
        ends = list(state.next_stored)
        for g, table in enumerate(tables):
            end = min(num_tokens // tpc, len(table) // k, len(hashes) // k)
            ends[g] = max(state.next_stored[g], end)
            start = state.next_stored[g]
            if self._mamba[g] or end <= start:
                continue
            mask = self._reachable(request, g, start, end)
            for c in range(start, end):
                seg = table[c * k : (c + 1) * k]
                if seg[-1] is None:
                    continue
                reach = mask[(c - start) * k : (c - start + 1) * k] if mask else [True] * k
                if not any(reach):
                    continue
                if self.config.v033 and any(
                    b is None and r for b, r in zip(seg, reach, strict=True)
                ):
                    self.stats["null_block_skips"] += 1  # 0.33: part would stay unwritten
                    continue
                rows = [(i, b) for i, b in enumerate(seg) if b is not None]
                offers.append(((hashes[c * k + k - 1], g), c, cast(list, rows)))
        if offers:
            done = self._prepare_store(request, state, offers, [o[0] for o in offers])
            if done < 0:
                return stored  # no room: offered again next step
            stored += done
        state.next_stored = ends
        return stored

    def _prepare_store(
        self,
        request: Request,
        state: _ReqState,
        offers: list[tuple[OffloadKey, int, list[tuple[int, KVBlock]]]],
        keys: list[OffloadKey],
    ) -> int:
        """``CPUOffloadingManager.prepare_store`` + submitting the copy; -1: no room."""
        todo = []
        ready_existing = []
        for offer in offers:
            chunk = self.policy.get(offer[0])
            if chunk is None:
                todo.append(offer)
            elif chunk.is_ready:
                ready_existing.append(offer[0])
        misses = [o[0] for o in todo if o[0] not in state.store_misses]
        if misses:
            self.policy.on_store_miss(misses)
            state.store_misses.update(misses)
        recorded = {o[0] for o in todo} | set(ready_existing)
        tpc = self.tokens_per_chunk
        self._seen(state, [(o[0], (o[1] + 1) * tpc) for o in offers if o[0] in recorded])
        state.reused.update(key for key in ready_existing if key not in state.inserted)
        if not todo:
            return 0
        shortfall = len(todo) - len(self._free_slots)
        if shortfall > 0:
            victims = self.policy.evict(shortfall, set(keys))
            if victims is None:
                self.stats["store_failures"] += 1
                logger.debug("request %s: no idle CPU chunk to evict", request.request_id)
                return -1
            self._drop(victims)
        k = self.k
        n_groups = len(self.specs)
        gpu_rows: list[list[int]] = [[] for _ in range(n_groups)]
        cpu_rows: list[list[int]] = [[] for _ in range(n_groups)]
        src: list[KVBlock] = []
        for key, c, rows in todo:
            chunk = Chunk(self._free_slots.pop())
            self.policy.insert(key, chunk, state)
            self._info[key] = self._snapshot(request, key[1], c)
            base = chunk.slot * k
            gpu_rows[key[1]].extend(block.block_id for _, block in rows)
            cpu_rows[key[1]].extend(base + offset for offset, _ in rows)
            src.extend(block for _, block in rows)
        state.inserted.update(o[0] for o in todo)
        due = self._step + 1 + self.config.copy_delay_steps
        job = self._new_job(_Job("store", [o[0] for o in todo], src, due))
        for block in src:
            self._pending_src[block] = job  # a block is read by at most one pending store
        copies = [GroupCopy(g, gpu_rows[g], cpu_rows[g]) for g in range(n_groups) if gpu_rows[g]]
        self.transfer.submit(job, "store", copies)
        self.stats["stores_submitted"] += len(todo)
        return len(todo)

    def request_finished(self, request: Request, tables: Sequence[Table]) -> None:
        """The request finished (or was preempted): its last chunks are offered and its
        accesses re-rank the policy at the next step's end (``request_finished`` ->
        ``_build_store_jobs`` over ``finished_req_ids`` -> ``on_request_finished``)."""
        self._finishing.append((request, [list(t) for t in tables]))

    def end_step(
        self,
        scheduled: Sequence[tuple[Request, Sequence[Table], Sequence[Sequence[int]]]],
        *,
        finish_step: bool = True,
    ) -> None:
        """End of an engine step (vLLM's ``build_connector_meta`` then
        ``update_connector_output``): offer the scheduled requests' chunks, then those of
        the requests that finished in an earlier step, re-rank for them, then complete the
        copies due. ``finish_step=False``: only the offers of ``scheduled``."""
        for request, tables, new_states in scheduled:
            self.store(request, tables, request.num_computed_tokens, new_states)
        if not finish_step:
            return
        finished, self._finished, self._finishing = self._finished, self._finishing, []
        for request, tables in finished:
            num = max(request.num_prompt_tokens, request.num_tokens - 1)
            self.store(request, tables, min(num, request.num_computed_tokens))
        for request, _ in finished:
            state = self._reqs.pop(request.request_id, None)
            if state is not None:
                self._on_request_finished(state)
        self._complete([j for j, job in self._jobs.items() if job.due_step <= self._step])
        self._step += 1

    def _on_request_finished(self, state: _ReqState) -> None:
        groups: dict[int, list[OffloadKey]] = {}
        for key in state.keys_seen:
            groups.setdefault(key[1], []).append(key)
        flat = [key for g in sorted(groups) for key in groups[g]]
        flat.sort(key=state.keys_seen.__getitem__)  # stable: head to tail, groups in order
        self.policy.on_request_finished(flat, state.inserted - state.reused, state.reused)

    @property
    def has_pending_work(self) -> bool:
        """vLLM's ``has_pending_push_work``: the engine keeps stepping while copies are in
        flight or finished requests still have chunks to offer."""
        return bool(self._finished or self._finishing) or any(
            j.kind == "store" for j in self._jobs.values()
        )

    def _snapshot(self, request: Request, g: int, c: int) -> _ChunkInfo:
        k, bs = self.k, self.block_size
        wires = request.wire_hashes
        lo, hi = c * k, (c + 1) * k
        if not (self.config.self_describing and self._full[g]):
            return _ChunkInfo([wires[hi - 1]], None, [], None, False)
        return _ChunkInfo(
            wires[lo:hi],
            wires[lo - 1] if lo else None,
            request.all_token_ids[lo * bs : hi * bs],
            request.lora_name,
            True,
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
        """Observe jobs done (waiting for copies still running) and publish stores."""
        self.transfer.wait(job_ids)
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
            block_size=self.block_size if info.described else 0,
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=info.lora_name,
            extra_keys=None,
            group_idx=key[1],
            kv_cache_spec_kind=spec.kind if info.described or self._classify else None,
            kv_cache_spec_sliding_window=(
                spec.sliding_window if info.described or self._classify else None
            ),
        )

    def poll(self) -> None:
        """Publish the stores whose copies are due (tests; ``end_step`` does this)."""
        self._complete([j for j, job in self._jobs.items() if job.due_step <= self._step])

    def wait_all(self) -> None:
        self._complete(list(self._jobs))

    def drain(self) -> None:
        """Finish everything pending as if the engine kept stepping idle: finished
        requests' offers, then every copy (tests, shutdown)."""
        for _ in range(4 + self.config.copy_delay_steps):
            if not self.has_pending_work:
                break
            self.end_step([])
        self.wait_all()

    def on_blocks_reused(self, blocks: list[KVBlock]) -> None:
        """Pool hook: a store still reading blocks about to be reused finishes its copy
        first (vLLM's ``jobs_to_flush``); the chunk stays in flight until it is due."""
        if not self._pending_src:
            return
        pending = self._pending_src
        jobs = {pending[b] for b in blocks if b in pending}
        if jobs:
            self.stats["store_flushes"] += 1
            self.transfer.wait(sorted(jobs))
            for b in blocks:
                pending.pop(b, None)

    # ---- state ----------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every chunk without events (``OffloadingConnectorScheduler.reset_cache``:
        running requests offer their chunks again from chunk 0)."""
        self.transfer.wait(list(self._jobs))
        self._jobs.clear()
        self.policy.clear()
        self._info.clear()
        self._pending_src.clear()
        for state in self._reqs.values():
            state.next_stored = [0] * len(self.specs)
            state.keys_seen.clear()
            state.inserted.clear()
            state.reused.clear()
            state.store_misses.clear()
            state.lru_rank = None
        self._finished.clear()
        self._finishing.clear()
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
