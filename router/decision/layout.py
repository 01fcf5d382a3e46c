"""Per-instance KV cache group layout: what each ``group_idx`` of an instance is.

The scorer needs each instance's groups (full attention / sliding window / Mamba, block
sizes) and its CPU offload chunk size. vLLM's ``BlockStored`` events carry ``group_idx``,
``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``, so the layout is learned from
the stream; engines that do not send them (older vLLM) fall back to a configured layout.
Precedence: configured for the instance > learned > the registry default.

The CPU chunk size (tokens per offloaded chunk) has its own precedence: configured (the
instance's ``--kv-transfer-config``, ``configure_chunk``; or a configured layout) >
learned from self-describing CPU events (their block count) > learned from where
placeholder CPU events fall in the GPU hash chains (``router.decision.chunking``) >
vLLM's default, one block per chunk. ``chunk_source`` says which one an instance's
layout uses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from events.groups import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    parse_layout,
    spec_from_event,
)
from events.structs import BlockStored, KVEventBatch
from router.decision.chunking import ChunkLearner
from router.index.base import GPU_MEDIA

__all__ = ["InstanceLayout", "LayoutRegistry", "SharedLayouts", "default_layout"]

log = logging.getLogger(__name__)


class SharedLayouts(Protocol):
    """Where an ingesting router shares the layouts it learned: the index
    (``router.index.base.BlockIndex.get_layouts``, one entry per instance)."""

    async def get_layouts(self) -> dict[str, dict[str, Any]]: ...


# The router's name for the one layout type (``events.groups.KVCacheLayout``, which the
# engine builds its pools from): what each ``group_idx`` of an instance is, its hash block
# size and its CPU chunk size.
InstanceLayout = KVCacheLayout


def default_layout(text: str, block_size: int) -> InstanceLayout:
    """The layout assumed until an instance's events teach its own, in the one layout
    grammar (``events.groups.parse_layout``); a full-attention group is put first when
    the text names none (``swa:1024``, ``mamba``: a hybrid beside full attention)."""
    layout = parse_layout(text, block_size)
    if any(isinstance(g, FullAttentionSpec) for g in layout.groups):
        return layout
    return InstanceLayout((FullAttentionSpec(block_size), *layout.groups))


class LayoutRegistry:
    """Layouts per instance: configured, learned from events, or the default.

    ``get`` runs for every candidate of every decision: its answers are remembered until
    any layout changes (every change goes through a method here, which forgets them)."""

    def __init__(
        self,
        default: InstanceLayout | None = None,
        configured: Mapping[str, InstanceLayout] | None = None,
    ) -> None:
        self._resolved: dict[str, InstanceLayout | None] = {}
        self._default = default
        self._configured: dict[str, InstanceLayout] = dict(configured or {})
        self._learned: dict[str, InstanceLayout] = {}
        self._seen: dict[str, dict[int, tuple[str | None, int | None, int]]] = {}
        self._chunk: dict[str, int] = {}  # tokens per CPU chunk, from self-describing events
        self._placed: dict[str, ChunkLearner] = {}  # ... from placeholders' chain positions
        # From the instance's --kv-transfer-config: (blocks per chunk, tokens per chunk).
        self._chunk_cfg: dict[str, tuple[int | None, int | None]] = {}
        self._warned: set[str] = set()  # instances whose block size disagreed (warned once)
        self._hinted: dict[str, InstanceLayout] = {}  # default groups at the engine's size
        # Moves whenever a learned layout changes: predict-on-route re-records what it
        # predicted for requests in flight under the layout they assumed.
        self.version = 0

    @property
    def default(self) -> InstanceLayout | None:
        return self._default

    @default.setter
    def default(self, layout: InstanceLayout | None) -> None:
        self._default = layout
        self._resolved.clear()

    def configure(self, instance: str, layout: InstanceLayout | None) -> None:
        if layout is None:
            self._configured.pop(instance, None)
        else:
            self._configured[instance] = layout
        self._resolved.clear()

    def configure_chunk(
        self, instance: str, *, blocks: int | None = None, tokens: int | None = None
    ) -> None:
        """The CPU chunk the instance's ``--kv-transfer-config`` sets (vLLM's
        ``blocks_per_chunk`` or ``block_size``; neither: forget it). Wins over learning."""
        if blocks is None and tokens is None:
            self._chunk_cfg.pop(instance, None)
        else:
            self._chunk_cfg[instance] = (blocks, tokens)
        self._resolved.clear()

    def chunk_source(self, instance: str) -> str:
        """Where the instance's CPU chunk size comes from (``/debug/route``)."""
        cfg = self._chunk_cfg.get(instance)
        if cfg is not None:
            blocks, tokens = cfg
            what = f"blocks_per_chunk={blocks}" if blocks is not None else f"block_size={tokens}"
            return f"configured: kv_transfer_config {what}"
        conf = self._configured.get(instance)
        if conf is not None:
            if conf.tokens_per_chunk:
                return "configured layout"
            return "default: one block per chunk (vLLM's default)"
        if instance in self._learned and instance in self._chunk:
            return "learned from self-describing CPU events"
        placed = self._placed.get(instance)
        if instance in self._learned and placed is not None and placed.tokens_per_chunk:
            how = "settled" if placed.settled else f"{placed.placed} agreeing so far"
            return f"learned from placeholder CPU events' places in GPU hash chains ({how})"
        layout = self.get(instance)
        if layout is not None and layout.tokens_per_chunk:
            return "default layout"
        return "default: one block per chunk (vLLM's default)"

    def get(self, instance: str) -> InstanceLayout | None:
        try:
            return self._resolved[instance]
        except KeyError:
            pass
        layout = (
            self._configured.get(instance)
            or self._learned.get(instance)
            or self._hinted.get(instance)
            or self._default
        )
        cfg = self._chunk_cfg.get(instance)
        if cfg is not None and layout is not None:
            layout = self._with_chunk(instance, layout, *cfg)
        if len(self._resolved) >= 4096:  # names asked about that no instance has
            self._resolved.clear()
        self._resolved[instance] = layout
        return layout

    def _with_chunk(
        self, instance: str, layout: InstanceLayout, blocks: int | None, tokens: int | None
    ) -> InstanceLayout:
        # vLLM's chunk is blocks_per_chunk GPU blocks of each group (the CPU build gives
        # every group one block size) or ``block_size`` tokens.
        tpc = tokens if tokens is not None else (blocks or 1) * layout.lcm_block_size
        if tpc == layout.tokens_per_chunk:
            return layout
        try:
            return replace(layout, tokens_per_chunk=tpc)
        except ValueError:
            log.warning("instance %s: configured CPU chunk of %d tokens won't fit", instance, tpc)
            return layout

    def hint_block_size(self, instance: str, block_size: int) -> None:
        """The engine's block size from its ``/metrics`` (``vllm:cache_config_info``):
        until its events teach the groups, hash its requests at that size."""
        if self.default is None or block_size <= 0:
            return
        groups = tuple(_resize(g, block_size) for g in self.default.groups)
        self._hinted[instance] = InstanceLayout(groups)
        self._resolved.clear()

    def learned(self, instance: str) -> InstanceLayout | None:
        return self._learned.get(instance)

    def source(self, instance: str) -> str:
        """Where ``get`` takes the instance's layout from (shown in ``/debug/route``)."""
        if instance in self._configured:
            return "configured"
        if instance in self._learned:
            return "learned from events"
        if instance in self._hinted:
            return "no events yet: block size from the engine's /metrics"
        return "default: no events from this instance yet" if self.default else "none"

    def forget(self, instance: str) -> None:
        self._learned.pop(instance, None)
        self._hinted.pop(instance, None)
        self._seen.pop(instance, None)
        self._chunk.pop(instance, None)
        self._placed.pop(instance, None)
        self._resolved.clear()

    def set_learned(self, instance: str, layout: InstanceLayout) -> bool:
        """Adopt a layout another process learned (shared index readers); True if it
        changed the instance's learned layout."""
        if self._learned.get(instance) == layout:
            return False
        self._learned[instance] = layout
        self._changed(instance)
        return True

    def _changed(self, instance: str) -> None:
        """A learned layout changed: forget resolved answers; the version moves."""
        self._resolved.clear()
        self.version += 1

    async def refresh_from(self, index: SharedLayouts) -> int:
        """Adopt the layouts ingesters shared through ``index.put_layout`` (a reader router
        sharing a Redis index learns no layouts itself); returns how many changed."""
        changed = 0
        for name, raw in (await index.get_layouts()).items():
            try:
                layout = InstanceLayout.from_dict(raw)
            except (KeyError, TypeError, ValueError):
                log.warning("instance %s: unreadable shared layout %r", name, raw)
                continue
            changed += self.set_learned(name, layout)
        return changed

    def observe(self, instance: str, batch: KVEventBatch) -> bool:
        """Learn from the batch's ``BlockStored`` events; True if the learned layout changed.

        GPU stores give each group's spec and block size -- empty ones too: with sparse
        retention a sliding-window or Mamba group often stores no hash at first, and a
        layout missing it would credit full-attention hits it cannot serve. Self-describing
        CPU stores
        (``block_size > 0``, one event per offloaded chunk, every block hash of a full
        attention or sliding-window group) give the chunk size; placeholder CPU stores
        (``block_size == 0``) carry none themselves, but where their hash falls in the GPU
        hash chains does (``router.decision.chunking.ChunkLearner``).
        """
        seen = self._seen.get(instance)
        changed = False
        placed = self._placed.get(instance)
        if placed is None:
            placed = self._placed[instance] = ChunkLearner()
        if instance in self._chunk:
            placed.stop()  # self-describing events name the size: nothing to learn
        elif placed.observe(batch):
            changed = True
        for ev in batch.events:
            if type(ev) is not BlockStored or ev.block_size <= 0:
                continue
            if ev.medium not in GPU_MEDIA:
                if not ev.block_hashes:
                    continue
                if ev.kv_cache_spec_kind != "mamba":  # a Mamba chunk names only its state
                    tpc = len(ev.block_hashes) * ev.block_size
                    if self._chunk.get(instance) != tpc:
                        self._chunk[instance] = tpc
                        changed = True
                continue
            key = (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.block_size)
            g = ev.group_idx or 0
            if seen is None:
                seen = self._seen[instance] = {}
            old = seen.get(g)
            if old == key:
                continue
            if old is not None and old[2] > ev.block_size and old[:2] == key[:2]:
                continue  # a partial-block store (prefix_match_unit): keep the group's size
            seen[g] = key
            changed = True
        if changed and seen:
            self._learned[instance] = self._build(instance, seen)
            self._changed(instance)
            return True
        return False

    def _build(
        self, instance: str, seen: dict[int, tuple[str | None, int | None, int]]
    ) -> InstanceLayout:
        base = self._configured.get(instance) or self.default
        n = max(seen) + 1
        groups: list[KVCacheSpec] = []
        for g in range(n):
            if g in seen:
                kind, window, bs = seen[g]
                if kind is None and base is not None and g < len(base.groups):
                    groups.append(_resize(base.groups[g], bs))  # engine sent no spec kind
                else:
                    groups.append(spec_from_event(kind, window, bs))
            elif base is not None and g < len(base.groups):
                groups.append(base.groups[g])
            else:  # not seen yet: a group with no blocks, so it hits nothing
                groups.append(FullAttentionSpec(seen[min(seen)][2]))
        # The engine hashes at its own block size (vLLM picks it: 32 on CPU whatever was
        # asked, larger for Mamba hybrids); the events' block sizes are the truth.
        placed = self._placed.get(instance)
        tpc = (
            self._chunk.get(instance)
            or (placed.tokens_per_chunk if placed is not None else None)
            or (base.tokens_per_chunk if base is not None else None)
        )
        layout = None
        for geometry in ((0, tpc), (0, None)):
            try:
                layout = InstanceLayout(tuple(groups), *geometry)
                break
            except ValueError:
                log.warning("instance %s: geometry %s does not fit its groups", instance, geometry)
        assert layout is not None  # (0, None) always fits
        log.info("instance %s layout: %s", instance, layout.to_dict())
        if (
            self.default is not None
            and instance not in self._configured
            and layout.hash_block_size != self.default.hash_block_size
            and instance not in self._warned
        ):
            self._warned.add(instance)
            log.warning(
                "instance %s hashes %d-token blocks (from its events), not the configured %d:"
                " using %d for it",
                instance,
                layout.hash_block_size,
                self.default.hash_block_size,
                layout.hash_block_size,
            )
        return layout


def _resize(spec: KVCacheSpec, block_size: int) -> KVCacheSpec:
    if isinstance(spec, SlidingWindowSpec | FullAttentionSpec | MambaSpec):
        return replace(spec, block_size=block_size)
    return spec  # pragma: no cover
