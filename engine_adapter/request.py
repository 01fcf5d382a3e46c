"""A request as the KV cache sees it: tokens, chained block hashes, progress.

Block hashes are computed once, incrementally, as tokens arrive (full blocks only), the
way vLLM's ``Request.block_hashes`` is: everything downstream (cache keys, events, offload
keys) reads them instead of re-hashing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from events.hashing import block_extra_keys, event_extra_keys, hash_request_blocks, wire_hash

__all__ = ["Request"]


@dataclass(eq=False)
class Request:
    """One sequence: prompt + generated tokens and their block hashes.

    ``num_computed_tokens`` is advanced by ``KVCacheManager.allocate_slots`` when tokens
    are scheduled (as vLLM's scheduler does at schedule time).
    """

    request_id: str
    prompt_token_ids: list[int]
    block_size: int = 16
    hash_algo: str = "sha256_cbor"
    hash_seed: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None  # keys block 0's hash: tenants never share a prefix
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[bytes] = field(init=False, default_factory=list)
    wire_hashes: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)
    num_gpu_hit_tokens: int = field(init=False, default=0)
    num_cpu_hit_tokens: int = field(init=False, default=0)
    # vLLM's shared-prefix junction, set at lookup: the longer prefix full attention held
    # when a sparse group cut the hit short; sparse groups then retain state there too.
    shared_prefix_boundary: int = field(init=False, default=0)
    num_preemptions: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens; blocks that become full get their hashes now."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def event_extra_keys(self, positions: list[int]) -> list[tuple[Any, ...] | None] | None:
        """``BlockStored.extra_keys`` for these blocks: untagged, one entry per block, None
        for an empty list (vLLM's ``to_event_extra_keys``)."""
        if not positions:
            return None
        keys = self._extra_keys(max(positions) + 1)
        return [event_extra_keys(keys[i]) if keys else None for i in positions]

    def _extra_keys(self, num_blocks: int) -> list[tuple[Any, ...] | None] | None:
        lora = (self.lora_name, self.lora_path) if self.lora_name is not None else None
        return block_extra_keys(num_blocks, lora=lora, cache_salt=self.cache_salt)

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        done = len(self.block_hashes)
        new_blocks = self.num_tokens // bs - done
        if new_blocks <= 0:
            return
        tokens = self.all_token_ids[done * bs : (done + new_blocks) * bs]
        parent = self.block_hashes[-1] if self.block_hashes else None
        keys = self._extra_keys(done + new_blocks)  # by position: the salt is block 0's
        new = hash_request_blocks(
            tokens,
            bs,
            self.hash_algo,
            self.hash_seed,
            keys[done:] if keys else None,
            parent=parent,
        )
        self.block_hashes.extend(new)
        self.wire_hashes.extend(wire_hash(h) for h in new)
