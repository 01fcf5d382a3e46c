"""Mooncake-format traces: loading, deterministic prompt text, subsets, the oracle hit ratio.

A Mooncake (FAST'25) record is ``{"timestamp": ms, "input_length", "output_length",
"hash_ids"}``, each hash id naming one 512-token block: the same id means the same tokens.
We turn an id into 512 printable ASCII characters (SHAKE-256 of ``seed:id`` mapped onto a
64-character alphabet) and a prompt into its blocks' text cut to ``input_length``. Our
engines tokenize bytes (token id = byte), so that text is exactly the intended tokens for
our router, for vllm-router (which re-tokenizes through the engine's ``/tokenize``) and for
sglang-router (a radix tree over the text) alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "TraceRequest",
    "block_text",
    "compress_arrivals",
    "load_mooncake",
    "oracle_hits",
    "prompt_text",
    "reindex",
    "sample_sessions",
    "save_mooncake",
    "session_key",
]

TRACE_BLOCK_TOKENS = 512
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 ."
_TABLE = bytes(_ALPHABET[b % len(_ALPHABET)] for b in range(256))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace record; ``index`` is its position in the replayed list."""

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "timestamp": self.timestamp_ms,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


@lru_cache(maxsize=65_536)
def block_text(block_id: int, seed: int = 0) -> str:
    """512 ASCII characters for ``block_id``: a pure function of ``(seed, block_id)``."""
    raw = hashlib.shake_256(f"kvroute-trace:{seed}:{block_id}".encode()).digest(TRACE_BLOCK_TOKENS)
    return raw.translate(_TABLE).decode("ascii")


def prompt_text(req: TraceRequest, seed: int = 0, block_chars: int = TRACE_BLOCK_TOKENS) -> str:
    """The request's blocks' text (each cut to ``block_chars``) cut to ``input_length``
    characters (= byte tokens)."""
    need = -(-req.input_length // block_chars)
    if need > len(req.hash_ids):
        raise ValueError(
            f"request {req.index}: {req.input_length} tokens need {need} blocks, "
            f"trace gives {len(req.hash_ids)}"
        )
    text = "".join(block_text(b, seed)[:block_chars] for b in req.hash_ids[:need])
    return text[: req.input_length]


def load_mooncake(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Records in file order (Mooncake traces are sorted by timestamp); ``limit`` first N."""
    out: list[TraceRequest] = []
    with Path(path).open() as fh:
        for line in fh:
            if limit is not None and len(out) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            out.append(
                TraceRequest(
                    len(out),
                    float(d["timestamp"]),
                    int(d["input_length"]),
                    int(d["output_length"]),
                    tuple(int(h) for h in d["hash_ids"]),
                )
            )
    return out


def save_mooncake(requests: Iterable[TraceRequest], path: str | Path) -> None:
    with Path(path).open("w") as fh:
        for r in requests:
            fh.write(json.dumps(r.to_json()) + "\n")


def session_key(req: TraceRequest) -> tuple[int, ...]:
    """A conversation's identity: its first two blocks (block 0 is often a shared system
    prompt; the next is the first block unique to the conversation)."""
    return req.hash_ids[:2]


def sample_sessions(
    requests: Sequence[TraceRequest], fraction: float, seed: int = 0
) -> list[TraceRequest]:
    """Keep whole conversations with probability ``fraction`` (re-indexed, order kept):
    a thinner trace over the same time span that keeps the reuse pattern."""
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    kept = []
    for r in requests:
        digest = hashlib.sha256(f"{seed}:{session_key(r)}".encode()).digest()
        if int.from_bytes(digest[:8], "big") / 2**64 < fraction:
            kept.append(r)
    return reindex(kept)


def reindex(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    return [
        TraceRequest(i, r.timestamp_ms, r.input_length, r.output_length, r.hash_ids)
        for i, r in enumerate(requests)
    ]


def oracle_hits(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, the tokens an infinite cache with perfect routing could reuse: the
    longest prefix of its hash ids that an earlier request also started with (whole
    512-token blocks), capped at ``input_length - 1`` (the last token is recomputed)."""
    seen: set[tuple] = set()
    hits = []
    for r in requests:
        key: tuple = ()
        k = 0
        matching = True
        for i, h in enumerate(r.hash_ids):
            key = (key, h)
            if matching and key in seen:
                k = i + 1
            else:
                matching = False
            seen.add(key)
        hits.append(max(0, min(k * TRACE_BLOCK_TOKENS, r.input_length - 1)))
    return hits


def compress_arrivals(requests: Sequence[TraceRequest], time_scale: float) -> list[float]:
    """Arrival offsets in seconds from the first request, divided by ``time_scale``."""
    if not requests:
        return []
    t0 = requests[0].timestamp_ms
    return [(r.timestamp_ms - t0) / 1000.0 / time_scale for r in requests]
