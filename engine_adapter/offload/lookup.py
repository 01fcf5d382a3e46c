"""How a request's prefix maps onto offloaded chunks: keys, CPU hit, recency touches.

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

__all__ = ["OffloadKey", "chunk_key", "num_cpu_hit_tokens", "touch_keys"]

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


def touch_keys(
    specs: Sequence[KVCacheSpec], request: Request, blocks_per_chunk: int
) -> list[OffloadKey]:
    """Keys whose recency a lookup refreshes, as vLLM's connector does.

    Full attention: every chunk of the prompt (a future hit needs the whole prefix).
    Sliding window / Mamba: only the last window of chunks (older ones never serve this
    prefix again). Groups in order, chunks ascending; policies walk them in reverse.
    """
    hashes = request.block_hashes
    k = blocks_per_chunk
    n_chunks = len(hashes) // k
    keys: list[OffloadKey] = []
    for g, spec in enumerate(specs):
        window = window_in_chunks(spec, k * spec.block_size)
        lo = 0 if window is None else max(0, n_chunks - window)
        keys.extend((hashes[(c + 1) * k - 1], g) for c in range(lo, n_chunks))
    return keys
