"""An instance's CPU offload chunk size, learned from where its placeholder CPU events fall.

vLLM's offloading connector keys a chunk of ``blocks_per_chunk`` GPU blocks by the hash of
its **last** block (``request.block_hashes[(i + 1) * hashes_per_chunk - 1]``), and with
its default placeholder events (``self_describing_kv_events`` false) a CPU
``BlockStored`` names that one hash and nothing of the chunk's size (``block_size`` 0).
The GPU events of the same prompt came earlier and announce its hash chain: a
full-attention ``BlockStored`` lists consecutive block hashes after ``parent_block_hash``
(None at the prompt's start), so the router can tell how many tokens each hash ends at.
Every chunk key ends at a multiple of ``tokens_per_chunk``, so the GCD of the ends of the
placeholders seen is the chunk size once two chunk indices without a common factor have
been seen (chunk 0 is among the first stored of nearly every prompt).

Until the instance's first placeholder the learner only remembers its last GPU stores
(up to ``recent_hashes`` hashes, the events as decoded: no work per hash) and places
nothing: an instance without a CPU tier -- most of a fleet -- costs one append per store
(placing every chain cost ~10-25 us per 32-block store and up to 6 MB per instance). The
first placeholder places those remembered stores, then itself: vLLM offloads a chunk after
its GPU blocks were stored, so its chain is among the last stores.

From then on the learner keeps hash -> end until the answer has held for
``settle_after`` placeholders in a row, within ``max_tracked`` entries (plus one store's)
in two generations -- when the newer holds half, the older goes at once: an O(1) swap and
one dict freed (~0.3 ms at 32k entries, where dropping the oldest half key by key held the
event loop ~3.6 ms). An instance restarts (forgetting its layout starts a new learner)
before its chunk size can change. Where the instance's self-describing CPU events tell the
size, the registry stops it (``stop``): nothing to learn, and nothing kept.
"""

from __future__ import annotations

import math
from collections import deque

from events.hashing import wire_hashes
from events.structs import BlockStored, ExternalBlockHash, KVEventBatch
from router.index.base import GPU_MEDIA, to_wire

__all__ = ["ChunkLearner"]

# vLLM spec kinds whose GPU stores list every block of a prompt in order (a window or
# Mamba group skips blocks it does not retain).
_CONTIGUOUS = {None, "full_attention", "mla_attention", "sink_full_attention"}


class ChunkLearner:
    """Tokens per CPU chunk from placeholder CPU events placed in GPU hash chains."""

    __slots__ = (
        "_ends", "_older", "_recent", "_recent_n", "max_tracked", "placed", "placing",
        "recent_hashes", "settle_after", "settled", "tokens_per_chunk",
    )  # fmt: skip

    def __init__(
        self, *, max_tracked: int = 65536, settle_after: int = 64, recent_hashes: int = 8192
    ) -> None:
        self._ends: dict[int, int] = {}  # wire hash -> tokens its block ends at (newest)
        self._older: dict[int, int] = {}  # the generation before (looked up second)
        # GPU stores remembered until the first placeholder: (parent, hashes, block size).
        self._recent: deque[tuple[ExternalBlockHash | None, list[ExternalBlockHash], int]] = deque()
        self._recent_n = 0  # hashes in _recent
        self.max_tracked = max_tracked
        self.recent_hashes = recent_hashes
        self.settle_after = settle_after
        self.tokens_per_chunk: int | None = None
        self.placed = 0  # placeholders placed since the answer last changed
        self.placing = False  # a placeholder was seen: GPU chains are placed as they come
        self.settled = False

    def stop(self) -> None:
        """The chunk size is told otherwise (the instance's self-describing CPU events):
        nothing to learn, and the hash -> end table (up to ``max_tracked`` entries, ~6 MB
        per instance: most of a cold router's memory in front of a fleet) goes."""
        self.settled = True
        self._ends, self._older = {}, {}
        self._recent.clear()
        self._recent_n = 0

    def _end(self, h: int) -> int | None:
        end = self._ends.get(h)
        return self._older.get(h) if end is None else end

    def observe(self, batch: KVEventBatch) -> bool:
        """Read one batch (in stream order); True if the learned chunk size changed."""
        if self.settled:
            return False
        changed = False
        for ev in batch.events:
            if type(ev) is not BlockStored or not ev.block_hashes:
                continue
            if ev.medium in GPU_MEDIA:
                if ev.block_size > 0 and ev.kv_cache_spec_kind in _CONTIGUOUS:
                    if self.placing:
                        self._chain(ev.parent_block_hash, ev.block_hashes, ev.block_size)
                    else:
                        self._remember(ev)
            elif ev.block_size == 0 and len(ev.block_hashes) == 1:  # a placeholder
                if not self.placing:
                    self._start_placing()
                end = self._end(_wire(ev.block_hashes[0]))
                if end is None:
                    continue  # its chain was announced before we listened
                tpc = end if self.tokens_per_chunk is None else math.gcd(self.tokens_per_chunk, end)
                if tpc != self.tokens_per_chunk:
                    self.tokens_per_chunk, self.placed, changed = tpc, 0, True
                else:
                    self.placed += 1
                    if self.placed >= self.settle_after:
                        self.stop()
                        return changed
        return changed

    def _remember(self, ev: BlockStored) -> None:
        recent = self._recent
        recent.append((ev.parent_block_hash, ev.block_hashes, ev.block_size))
        self._recent_n += len(ev.block_hashes)
        while self._recent_n > self.recent_hashes and len(recent) > 1:
            self._recent_n -= len(recent.popleft()[1])

    def _start_placing(self) -> None:
        self.placing = True
        for parent, hashes, block_size in self._recent:
            self._chain(parent, hashes, block_size)
        self._recent.clear()
        self._recent_n = 0

    def _chain(
        self, parent: ExternalBlockHash | None, block_hashes: list[ExternalBlockHash], bs: int
    ) -> None:
        if parent is None:
            base = 0
        else:
            found = self._end(_wire(parent))
            if found is None:
                return  # the chain's start was not seen: its positions are unknown
            base = found
        hashes = wire_hashes(block_hashes)
        ends = self._ends
        ends.update(zip(hashes, range(base + bs, base + bs * (len(hashes) + 1), bs), strict=True))
        if len(ends) >= self.max_tracked // 2:  # a new generation; the oldest half goes
            self._older, self._ends = ends, {}


def _wire(h: object) -> int:
    # Hashes are ints or digests; the exact-type check is not narrowed by mypy.
    return h if type(h) is int else to_wire(h)  # type: ignore[arg-type]
