"""The CPU-tier extension of a prefix hit, as vLLM's offloading connector computes it.

vLLM's ``OffloadingConnectorScheduler`` (``get_num_new_matched_tokens`` -> ``_lookup``)
runs *after* the GPU prefix hit and asks how many more tokens it can load from offloaded
chunks (a chunk = ``tokens_per_chunk`` tokens, i.e. several GPU blocks, keyed by the hash
of its last block). That is not "the GPU hit rule over GPU-or-CPU residency": a load
brings whole chunks, needs at least one whole chunk beyond the GPU hit, ignores GPU
residency past the GPU hit, and caps the hit differently (``num_tokens`` for
full-attention-only models -- the last token is recomputed after the load -- else
``num_tokens - 1``, rounded down to a chunk when a Mamba group is present). Per group:

* full attention: consecutive offloaded chunks from the chunk holding the GPU hit end;
* sliding window (window = ``cdiv(sliding_window, tokens_per_chunk)`` chunks) and Mamba
  (window = 1 chunk, the state at the chunk end): scanning from the right, the end of the
  last run of ``window`` consecutive offloaded chunks; failing that, the run of offloaded
  chunks starting at the GPU hit (the GPU hit's own window covers the rest).

Full attention goes first, then windowed groups by decreasing window, repeated until no
windowed group shrinks the hit (the same fixed point as the GPU rule). The engine calls
:func:`offload_hit` and the router the same rule on its index masks
(:func:`offload_rule`, compiled once per layout and chunk size), so the router predicts
exactly what the engine loads. Runs of chunks are found with a few big-int operations per
group, not one call per chunk (tests hold it to a chunk-by-chunk transcription of vLLM's
loop). No torch here: routers import this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

from events.groups import (
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    longest_cache_hit,
)

__all__ = [
    "OffloadRule",
    "cpu_extension",
    "cpu_extension_masks",
    "offload_hit",
    "offload_rule",
    "window_in_chunks",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_in_chunks(spec: KVCacheSpec, tokens_per_chunk: int) -> int | None:
    """Chunks a windowed group needs before a hit end (None: full attention needs all)."""
    if isinstance(spec, SlidingWindowSpec):
        return _cdiv(spec.sliding_window, tokens_per_chunk)
    if isinstance(spec, MambaSpec):
        return 1
    return None


@lru_cache(maxsize=4096)
def _every(stride: int, count: int) -> int:
    """Bits 0, stride, 2 * stride, ... (``count`` of them): one per chunk."""
    return ((1 << (count * stride)) - 1) // ((1 << stride) - 1) if count > 0 else 0


def _chunks(stride: int, lo: int, hi: int) -> int:
    """The bits of chunks ``lo <= c < hi`` (chunk c at bit ``c * stride``)."""
    return _every(stride, hi) & -(1 << (lo * stride)) if hi > lo else 0


def _leading(cached: int, stride: int, lo: int, hi: int) -> int:
    """Consecutive cached chunks from chunk ``lo`` on (at most ``hi - lo``)."""
    missing = _chunks(stride, lo, hi) & ~cached
    if not missing:
        return hi - lo
    return ((missing & -missing).bit_length() - 1) // stride - lo


def _window_lookup(cached: int, stride: int, lo: int, hi: int, window: int, first: int) -> int:
    """vLLM's windowed-group lookup over chunks ``[lo, hi)``; returns an end relative to lo.

    Scanning from the right: the trailing run of cached chunks counts if it is ``first``
    chunks long (a hit end inside a chunk needs the window to reach one chunk further
    back); past the last missing chunk, the end of the rightmost run of ``window`` cached
    chunks; failing both, the run of cached chunks starting at ``lo``.
    """
    missing = _chunks(stride, lo, hi) & ~cached
    if not missing:
        return hi - lo  # all cached (if shorter than ``first``, it is also the leading run)
    last_miss = (missing.bit_length() - 1) // stride
    if hi - 1 - last_miss >= first:
        return hi - lo
    runs = cached & _chunks(stride, lo, last_miss)
    have = 1
    # Invariant: bit c * stride of ``runs`` is set iff chunks c .. c + have - 1 are cached.
    while runs and have < window:
        shift = min(have, window - have)
        runs &= runs >> (shift * stride)
        have += shift
    if runs:
        return (runs.bit_length() - 1) // stride + window - lo
    return ((missing & -missing).bit_length() - 1) // stride - lo


class OffloadRule:
    """One layout's CPU-extension rule for one chunk size, geometry worked out once (group
    order, windows in chunks, blocks per chunk): routers evaluate it for every candidate
    instance of every request."""

    __slots__ = ("mamba", "order", "specs", "tokens_per_chunk", "windowed")

    def __init__(self, specs: Sequence[KVCacheSpec], tokens_per_chunk: int) -> None:
        tpc = tokens_per_chunk
        if tpc <= 0:
            raise ValueError(f"tokens_per_chunk must be positive, got {tpc}")
        for s in specs:
            if tpc % s.block_size:
                raise ValueError(f"tokens_per_chunk {tpc} is not a multiple of {s.block_size}")
        self.specs = tuple(specs)
        self.tokens_per_chunk = tpc
        windows = [window_in_chunks(s, tpc) for s in self.specs]

        def group(g: int) -> tuple[int, int | None, int, int]:
            # (group_idx, window in chunks or None, blocks per chunk, sliding window tokens)
            spec = self.specs[g]
            sw = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else 0
            return g, windows[g], tpc // spec.block_size, sw

        full = [g for g, w in enumerate(windows) if w is None]
        windowed = [g for g, w in enumerate(windows) if w is not None]
        windowed.sort(key=lambda g: -(windows[g] or 0))  # largest window first
        self.order = tuple(group(g) for g in [*full, *windowed])
        self.windowed = tuple(group(g) for g in windowed)
        self.mamba = any(isinstance(s, MambaSpec) for s in self.specs)

    def extension(self, cpu_masks: Sequence[int], num_tokens: int, gpu_hit: int) -> int:
        """See :func:`cpu_extension_masks`."""
        if not self.specs or num_tokens <= 0:
            return 0
        tpc = self.tokens_per_chunk
        max_hit = num_tokens
        if self.windowed:
            max_hit -= 1  # the last prompt token is recomputed for its logits
        if self.mamba:
            max_hit -= max_hit % tpc
        num_keys = num_tokens // tpc
        start = gpu_hit // tpc
        hit = 0
        pending = self.order
        while pending:
            looked_windowed = False
            current, pending = pending, ()
            for g, window, stride, sliding_window in current:
                max_hit = min(max_hit, num_keys * tpc)
                if max_hit - gpu_hit < tpc:
                    return 0
                num_chunks = min(_cdiv(max_hit, tpc), num_keys)
                # Chunk c's key is its last block, (c + 1) * stride - 1: move it to c * stride.
                cached = cpu_masks[g] >> (stride - 1)
                if window is None:
                    n = _leading(cached, stride, start, num_chunks)
                else:
                    first = window
                    if sliding_window:
                        pad = -min(max_hit, num_chunks * tpc) % tpc
                        first = max(window, _cdiv(sliding_window - 1 + pad, tpc))
                    n = _window_lookup(cached, stride, start, num_chunks, window, first)
                if n == 0:
                    return 0
                max_hit = min(max_hit, tpc * (start + n))
                new_hit = max_hit - gpu_hit
                if new_hit < tpc:
                    return 0
                if new_hit < hit and looked_windowed and not pending:
                    pending = self.windowed  # re-confirm the windows already checked
                looked_windowed |= window is not None
                hit = new_hit
        return hit


@lru_cache(maxsize=256)
def offload_rule(specs: tuple[KVCacheSpec, ...], tokens_per_chunk: int) -> OffloadRule:
    """The compiled :class:`OffloadRule` (cached: layouts are few); ValueError if the chunk
    size is not a multiple of every group's block size."""
    return OffloadRule(specs, tokens_per_chunk)


def cpu_extension_masks(
    specs: Sequence[KVCacheSpec],
    cpu_masks: Sequence[int],
    num_tokens: int,
    gpu_hit: int,
    tokens_per_chunk: int,
) -> int:
    """Tokens beyond ``gpu_hit`` loadable from offloaded chunks (0 if under one chunk).

    ``cpu_masks[g]`` has bit i set iff group g's block i is offloaded; only the last block
    of each chunk is read (the chunk's key, which every vLLM CPU event names, placeholder
    or self-describing). ``num_tokens`` is the prompt length. Runs of chunks are found with
    a few big-int operations per group, not a loop over chunks.
    """
    if not specs or tokens_per_chunk <= 0 or num_tokens <= 0:
        return 0
    return offload_rule(tuple(specs), tokens_per_chunk).extension(cpu_masks, num_tokens, gpu_hit)


def cpu_extension(
    specs: Sequence[KVCacheSpec],
    cpu_cached: Callable[[int, int], bool],
    num_tokens: int,
    gpu_hit: int,
    tokens_per_chunk: int,
) -> int:
    """:func:`cpu_extension_masks` with ``cpu_cached(group_idx, block_idx)`` instead of
    masks; only chunk keys (a chunk's last block) from the GPU hit's chunk on are asked."""
    if not specs or tokens_per_chunk <= 0 or num_tokens <= 0:
        return 0
    rule = offload_rule(tuple(specs), tokens_per_chunk)
    masks = [0] * len(specs)
    for g, _, stride, _ in rule.order:
        m = 0
        for c in range(gpu_hit // tokens_per_chunk, num_tokens // tokens_per_chunk):
            key = (c + 1) * stride - 1
            if cpu_cached(g, key):
                m |= 1 << key
        masks[g] = m
    return rule.extension(masks, num_tokens, gpu_hit)


def offload_hit(
    specs: Sequence[KVCacheSpec],
    gpu_cached: Callable[[int, int], bool],
    cpu_cached: Callable[[int, int], bool],
    num_tokens: int,
    tokens_per_chunk: int,
) -> tuple[int, int]:
    """``(gpu_tokens, cpu_tokens)`` an engine reuses for a ``num_tokens`` prompt.

    ``gpu_tokens`` is :func:`events.groups.longest_cache_hit` capped at ``num_tokens - 1``;
    ``cpu_tokens`` is what the offloading connector loads on top (:func:`cpu_extension`).
    ``gpu_tokens + cpu_tokens`` may equal ``num_tokens`` for full-attention-only models;
    the engine then still recomputes the last token.
    """
    gpu = longest_cache_hit(specs, gpu_cached, num_tokens - 1)
    return gpu, cpu_extension(specs, cpu_cached, num_tokens, gpu, tokens_per_chunk)
