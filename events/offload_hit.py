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
windowed group shrinks the hit (the same fixed point as the GPU rule). The engine and the
router both call :func:`offload_hit`, so the router predicts exactly what the engine loads.
No torch here: routers import this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from events.groups import (
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    longest_cache_hit,
)

__all__ = ["cpu_extension", "offload_hit", "window_in_chunks"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_in_chunks(spec: KVCacheSpec, tokens_per_chunk: int) -> int | None:
    """Chunks a windowed group needs before a hit end (None: full attention needs all)."""
    if isinstance(spec, SlidingWindowSpec):
        return _cdiv(spec.sliding_window, tokens_per_chunk)
    if isinstance(spec, MambaSpec):
        return 1
    return None


def _window_lookup(hits: list[bool], window: int, first_window: int) -> int:
    """End of the last run of ``window`` hits scanning from the right, else the leading run.

    The rightmost run may need ``first_window`` chunks (a hit end inside a chunk needs
    the window to reach one chunk further back).
    """
    run = 0
    required = first_window
    for idx in range(len(hits) - 1, -1, -1):
        if hits[idx]:
            run += 1
        else:
            run = 0
            required = window
        if run == required:
            return idx + required
    return run


def cpu_extension(
    specs: Sequence[KVCacheSpec],
    cpu_cached: Callable[[int, int], bool],
    num_tokens: int,
    gpu_hit: int,
    tokens_per_chunk: int,
) -> int:
    """Tokens beyond ``gpu_hit`` loadable from offloaded chunks (0 if under one chunk).

    ``cpu_cached(group_idx, block_idx)`` says whether that group's block is offloaded;
    only the last block of each chunk is asked (the chunk's key, which every vLLM CPU
    event names, placeholder or self-describing). ``num_tokens`` is the prompt length.
    """
    if not specs or tokens_per_chunk <= 0 or num_tokens <= 0:
        return 0
    tpc = tokens_per_chunk
    per_chunk = []
    for s in specs:
        if tpc % s.block_size:
            raise ValueError(f"tokens_per_chunk {tpc} is not a multiple of {s.block_size}")
        per_chunk.append(tpc // s.block_size)
    windows = [window_in_chunks(s, tpc) for s in specs]
    full = [g for g, w in enumerate(windows) if w is None]
    windowed = sorted(
        (g for g, w in enumerate(windows) if w is not None),
        key=lambda g: -(windows[g] or 0),
    )
    max_hit = num_tokens
    if windowed:
        max_hit -= 1  # the last prompt token is recomputed for its logits
    if any(isinstance(s, MambaSpec) for s in specs):
        max_hit -= max_hit % tpc
    num_keys = num_tokens // tpc
    start = gpu_hit // tpc

    def chunk_cached(g: int, c: int) -> bool:
        return cpu_cached(g, (c + 1) * per_chunk[g] - 1)

    hit = 0
    pending = [*full, *windowed]
    while pending:
        looked_windowed = False
        current, pending = pending, []
        for g in current:
            max_hit = min(max_hit, num_keys * tpc)
            if max_hit - gpu_hit < tpc:
                return 0
            num_chunks = min(_cdiv(max_hit, tpc), num_keys)
            window = windows[g]
            if window is None:
                n = 0
                while start + n < num_chunks and chunk_cached(g, start + n):
                    n += 1
            else:
                first = window
                spec = specs[g]
                if isinstance(spec, SlidingWindowSpec):
                    pad = -min(max_hit, num_chunks * tpc) % tpc
                    first = max(window, _cdiv(spec.sliding_window - 1 + pad, tpc))
                flags = [chunk_cached(g, c) for c in range(start, num_chunks)]
                n = _window_lookup(flags, window, first)
            if n == 0:
                return 0
            max_hit = min(max_hit, tpc * (start + n))
            new_hit = max_hit - gpu_hit
            if new_hit < tpc:
                return 0
            if new_hit < hit and looked_windowed and not pending:
                pending = list(windowed)  # re-confirm windows already checked this pass
            looked_windowed |= window is not None
            hit = new_hit
    return hit


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
