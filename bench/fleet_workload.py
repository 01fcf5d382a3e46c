"""``kvroute bench fleet``'s workload: what each simulated engine of a fleet has cached, as
the event batches vLLM would have published for it, and the requests whose routing the
benchmark checks.

Deterministic in ``(FleetShape, instance index)``: the publisher process, the router
process and the orchestrator each rebuild what they need from the shape alone.

Per instance, one batch per engine step (``step_blocks`` blocks of prefill):

* a hybrid layout: group 0 full attention, group 1 sliding window ``window`` tokens, both
  ``block_size``-token blocks; a GPU ``BlockStored`` per group per step (the window group
  stores only the blocks of the window at the end of the step's chunk, as vLLM's
  sliding-window manager keeps them), with the blocks' ``token_ids`` as vLLM sends them;
* a CPU tier: ``cpu_fraction`` of the full-attention steps are also offloaded, one
  self-describing ``medium="CPU"`` store per ``cpu_chunk_blocks``-block chunk;
* every instance holds the fleet's shared system prefix (``system_blocks`` blocks of every
  document); each document's ``holders`` hold longer prefixes of it (the first holder the
  longest): the document's expected holder and credited tokens;
* unrelated prompts (random hashes, ``noise_blocks`` each) up to the entry target, a fifth
  of them later evicted (``BlockRemoved``) -- the churn a real cache shows.

A request for document ``d`` is its first ``query_share`` of tokens followed by fresh
tokens, ``prompt_tokens`` in all: the expected holder is ``holders(d)[0]`` with
``gpu = hold_blocks(d, 0) * block_size`` tokens, ``cpu = 0`` (CPU copies never extend
past what the GPU holds here).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

from events.structs import BlockRemoved, BlockStored, KVEventBatch

__all__ = ["FleetShape", "Query", "instance_batches", "queries", "query"]

HASH_ALGO = "sha256_cbor"
HASH_SEED = "0"
VOCAB = 150_000
HOLD_SHARES = (0.9, 0.6, 0.3)  # prefix of its document each holder keeps, best first


@dataclass(frozen=True)
class FleetShape:
    instances: int
    entries: int  # (instance, group, tier, block) entries the fleet holds in all
    prompt_tokens: int = 240_000
    block_size: int = 16
    window: int = 128
    docs: int = 4
    holders: int = 3
    system_blocks: int = 256
    step_blocks: int = 512
    cpu_fraction: float = 0.3
    cpu_chunk_blocks: int = 16
    noise_blocks: int = 2048
    query_share: float = 0.95
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def window_blocks(self) -> int:
        """Blocks a sliding-window group needs at the end of a hit (window - 1 tokens)."""
        return -(-(self.window - 1) // self.block_size)

    @property
    def doc_blocks(self) -> int:
        return self.prompt_tokens // self.block_size

    def holders_of(self, doc: int) -> list[int]:
        picked: list[int] = []
        k = 0
        while len(picked) < min(self.holders, self.instances):
            i = (doc * 7919 + k * 104_729 + 1) % self.instances
            if i not in picked:
                picked.append(i)
            k += 1
        return picked

    def hold_blocks(self, doc: int, rank: int) -> int:
        share = HOLD_SHARES[rank % len(HOLD_SHARES)]
        return max(self.system_blocks + 1, int(self.doc_blocks * share))


@lru_cache(maxsize=64)
def doc_tokens(shape: FleetShape, doc: int) -> tuple[int, ...]:
    """Document ``doc``'s tokens: the shared system prefix, then its own."""
    system = random.Random(f"{shape.seed}:system")
    rng = random.Random(f"{shape.seed}:doc:{doc}")
    n_sys = shape.system_blocks * shape.block_size
    head = [system.randrange(VOCAB) for _ in range(n_sys)]
    return tuple(head + [rng.randrange(VOCAB) for _ in range(shape.prompt_tokens - n_sys)])


@lru_cache(maxsize=64)
def doc_hashes(shape: FleetShape, doc: int) -> tuple[int, ...]:
    """The wire hashes vLLM would publish for the document's blocks (and the router
    computes from the same tokens)."""
    from events.hashing import hash_request_blocks, wire_hashes

    digests = hash_request_blocks(
        list(doc_tokens(shape, doc)), shape.block_size, HASH_ALGO, HASH_SEED
    )
    return tuple(wire_hashes(digests))


def _stored(
    shape: FleetShape, hashes: list[int], tokens: list[int], group: int, medium: str
) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=shape.block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind="full_attention" if group == 0 else "sliding_window",
        kv_cache_spec_sliding_window=None if group == 0 else shape.window,
    )


class _Stream:
    """Builds one instance's batches and counts its resident entries."""

    def __init__(self, shape: FleetShape, rng: random.Random) -> None:
        self.shape, self.rng = shape, rng
        self.batches: list[KVEventBatch] = []
        self.entries = 0
        self.blocks = 0  # block events (stored + removed), what ingest rates count
        self._filler = [rng.randrange(VOCAB) for _ in range(shape.step_blocks * shape.block_size)]

    def _tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        bs = self.shape.block_size
        if tokens is not None:
            return tokens
        if n * bs <= len(self._filler):
            return self._filler[: n * bs]
        return (self._filler * (n * bs // len(self._filler) + 1))[: n * bs]

    def prompt(self, hashes: list[int], tokens: list[int] | None, start: int = 0) -> None:
        """Store a prompt's blocks from ``start`` on (those before are cached already)
        step by step, as an engine's prefill would."""
        s = self.shape
        bs, step, w = s.block_size, s.step_blocks, s.window_blocks
        for lo in range(start, len(hashes), step):
            hi = min(len(hashes), lo + step)
            chunk_tokens = tokens[lo * bs : hi * bs] if tokens is not None else None
            events: list[Any] = [
                _stored(s, hashes[lo:hi], self._tokens(chunk_tokens, hi - lo), 0, "GPU")
            ]
            wlo = max(lo, hi - w)
            wtok = chunk_tokens[(wlo - lo) * bs :] if chunk_tokens is not None else None
            events.append(_stored(s, hashes[wlo:hi], self._tokens(wtok, hi - wlo), 1, "GPU"))
            n = (hi - lo) + (hi - wlo)
            if self.rng.random() < s.cpu_fraction:
                c = s.cpu_chunk_blocks
                for clo in range(lo, hi - c + 1, c):
                    ctok = (
                        chunk_tokens[(clo - lo) * bs : (clo - lo + c) * bs]
                        if chunk_tokens
                        else None
                    )
                    events.append(
                        _stored(s, hashes[clo : clo + c], self._tokens(ctok, c), 0, "CPU")
                    )
                    n += c
            self.entries += n
            self.blocks += n
            self.batches.append(KVEventBatch(ts=0.0, events=events))

    def evict(self, hashes: list[int]) -> None:
        """Evict a prompt's GPU blocks (both groups; its CPU copies stay)."""
        s = self.shape
        full = len(hashes)
        windows: set[int] = set()
        for lo in range(0, full, s.step_blocks):
            hi = min(full, lo + s.step_blocks)
            windows.update(hashes[max(lo, hi - s.window_blocks) : hi])
        swa = [h for h in hashes if h in windows]
        self.batches.append(
            KVEventBatch(
                ts=0.0,
                events=[
                    BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=0),
                    BlockRemoved(block_hashes=swa, medium="GPU", group_idx=1),
                ],
            )
        )
        self.entries -= full + len(swa)
        self.blocks += full + len(swa)


def instance_batches(shape: FleetShape, i: int) -> tuple[list[KVEventBatch], int, int]:
    """Instance ``i``'s batches in publishing order, its resident entries at the end, and
    its block events."""
    rng = random.Random(f"{shape.seed}:instance:{i}")
    st = _Stream(shape, rng)
    target = shape.entries // shape.instances
    held = [(d, r) for d in range(shape.docs) for r, h in enumerate(shape.holders_of(d)) if h == i]
    # Unrelated prompts first (a fifth of them evicted later), then the documents.
    per_entry = 1 + shape.window_blocks / shape.step_blocks + shape.cpu_fraction
    doc_entries = sum(shape.hold_blocks(d, r) for d, r in held) * per_entry
    sys_entries = shape.system_blocks * per_entry
    budget = max(0.0, target - doc_entries - sys_entries)
    noise: list[list[int]] = []
    while st.entries < budget:
        hs = [rng.getrandbits(64) for _ in range(shape.noise_blocks)]
        st.prompt(hs, None)
        noise.append(hs)
        if len(noise) >= 2 and rng.random() < 0.2:
            st.evict(noise.pop(rng.randrange(len(noise) - 1)))
    if not held:
        d = i % shape.docs
        st.prompt(list(doc_hashes(shape, d)[: shape.system_blocks]),
                  list(doc_tokens(shape, d)[: shape.system_blocks * shape.block_size]))  # fmt: skip
    for k, (d, r) in enumerate(held):  # the shared system prefix is stored once
        n = shape.hold_blocks(d, r)
        hs, ts = doc_hashes(shape, d)[:n], doc_tokens(shape, d)[: n * shape.block_size]
        st.prompt(list(hs), list(ts), 0 if k == 0 else shape.system_blocks)
    return st.batches, st.entries, st.blocks


@dataclass(frozen=True)
class Query:
    doc: int
    tokens: list[int]
    holder: int  # instance index
    gpu_tokens: int
    cpu_tokens: int


def query(shape: FleetShape, k: int, salt: str = "q") -> Query:
    """Request ``k``: document ``k % docs`` with its own fresh tail."""
    keep = int(shape.prompt_tokens * shape.query_share)
    d = k % shape.docs
    rng = random.Random(f"{shape.seed}:{salt}:{k}")
    tokens = list(doc_tokens(shape, d)[:keep])
    tokens += [rng.randrange(VOCAB) for _ in range(shape.prompt_tokens - keep)]
    best = shape.holders_of(d)[0]
    gpu = min(shape.hold_blocks(d, 0), keep // shape.block_size) * shape.block_size
    gpu = min(gpu, (shape.prompt_tokens - 1) // shape.block_size * shape.block_size)
    return Query(d, tokens, best, gpu, 0)


def queries(shape: FleetShape, n: int, salt: str = "q") -> list[Query]:
    """``n`` requests cycling over the documents, each with its own fresh tail (all at
    once: ~2 MB each at 240k tokens; ``query`` makes one at a time)."""
    return [query(shape, k, salt) for k in range(n)]
