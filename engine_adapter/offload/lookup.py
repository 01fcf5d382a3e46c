"""How a request's prefix maps onto offloaded chunks: keys and the CPU hit.

Chunk ``c`` of group ``g`` covers GPU blocks ``[c*k, (c+1)*k)`` and is keyed, as in vLLM,
by the digest of its *last* block and the group: ``(block_hashes[(c+1)*k - 1], g)``. The
hit itself is :func:`events.offload_hit.cpu_extension`, the function the router calls on
event-derived residency, fed here with the tier's own readiness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine_adapter.request import Request
from events.groups import KVCacheSpec
from events.offload_hit import cpu_extension, window_in_chunks

__all__ = ["OffloadKey", "chunk_key", "hit_chunk_keys", "num_cpu_hit_tokens"]

# (digest of the chunk's last block, group_idx)
OffloadKey = tuple[bytes, int]


def chunk_key(
    request: Request, group_idx: int, chunk_idx: int, blocks_per_chunk: int
) -> OffloadKey:
    return (request.block_hashes[(chunk_idx + 1) * blocks_per_chunk - 1], group_idx)


def num_cpu_hit_tokens(
    specs: Sequence[KVCacheSpec],
    request: Request,
    gpu_hit: int,
    tokens_per_chunk: int,
    is_ready: Callable[[OffloadKey], bool],
) -> int:
    """Tokens beyond ``gpu_hit`` this request can load from ready chunks."""
    hashes = request.block_hashes

    def cpu_cached(g: int, i: int) -> bool:
        return i < len(hashes) and is_ready((hashes[i], g))

    return cpu_extension(specs, cpu_cached, request.num_tokens, gpu_hit, tokens_per_chunk)


def hit_chunk_keys(
    specs: Sequence[KVCacheSpec],
    request: Request,
    blocks_per_chunk: int,
    start_tokens: int,
    end_tokens: int,
) -> list[OffloadKey]:
    """Keys of the chunks a CPU hit over tokens ``[start_tokens, end_tokens)`` reads: every
    chunk for full attention, the last ``window`` chunks for a windowed group (vLLM's
    ``_lookup_complete_chunks`` delay check over ``_chunks_being_loaded``)."""
    hashes = request.block_hashes
    k = blocks_per_chunk
    keys: list[OffloadKey] = []
    for g, spec in enumerate(specs):
        tpc = k * spec.block_size
        lo, hi = start_tokens // tpc, -(-end_tokens // tpc)
        window = window_in_chunks(spec, tpc)
        if window is not None:
            lo = max(lo, hi - window)
        keys.extend((hashes[(c + 1) * k - 1], g) for c in range(lo, hi))
    return keys
