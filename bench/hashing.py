"""Block hashing benchmark: ``hash_request_blocks`` vs a naive per-block serialiser loop.

The target (issue #2) is sha256_cbor of an 8,192-token prompt with block size 16 in
<= 0.5 ms median; the naive loop is what a straightforward router would write.
"""

from __future__ import annotations

import hashlib
import pickle
import random
from pathlib import Path

import cbor2
import xxhash
from rich.console import Console
from rich.table import Table

from bench.common import summary_ms, time_calls, write_report
from events.hashing import HASH_ALGOS, hash_request_blocks, none_hash


def _naive(algo: str, tokens: list[int], block_size: int, seed: str) -> list[bytes]:
    ser = (
        (lambda o: cbor2.dumps(o, canonical=True))
        if algo.endswith("_cbor")
        else (lambda o: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL))
    )
    dig = (
        (lambda b: hashlib.sha256(b).digest()) if algo.startswith("sha") else xxhash.xxh3_128_digest
    )
    prev = none_hash(algo, seed)
    out = []
    for i in range(len(tokens) // block_size):
        prev = dig(ser((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), None)))
        out.append(prev)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    """Median/p10/p90 plus the min: on a shared machine the min is the least noisy figure."""
    return {**summary_ms(samples), "min_ms": min(samples) * 1e3}


def run(out: Path, num_tokens: int = 8192, block_size: int = 16, repeats: int = 200) -> dict:
    rng = random.Random(0)
    tokens = [rng.randrange(152_000) for _ in range(num_tokens)]
    rows = []
    for algo in HASH_ALGOS:
        assert hash_request_blocks(tokens, block_size, algo, "0") == _naive(
            algo, tokens, block_size, "0"
        )
        fast = _summary(
            time_calls(lambda a=algo: hash_request_blocks(tokens, block_size, a, "0"), repeats)
        )
        naive = _summary(
            time_calls(lambda a=algo: _naive(a, tokens, block_size, "0"), max(20, repeats // 5))
        )
        rows.append(
            {
                "algo": algo,
                "fast": fast,
                "naive": naive,
                "speedup": naive["median_ms"] / fast["median_ms"],
            }
        )
    report = {
        "benchmark": "hash",
        "num_tokens": num_tokens,
        "block_size": block_size,
        "target_sha256_cbor_median_ms": 0.5,
        "results": rows,
    }
    path = write_report(out, "hash", report)
    table = Table(title=f"hash_request_blocks, {num_tokens} tokens, block size {block_size}")
    cols = ("algo", "fast median ms", "fast min ms", "fast p90 ms", "naive median ms", "speedup")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["algo"],
            f"{r['fast']['median_ms']:.3f}",
            f"{r['fast']['min_ms']:.3f}",
            f"{r['fast']['p90_ms']:.3f}",
            f"{r['naive']['median_ms']:.3f}",
            f"{r['speedup']:.1f}x",
        )
    console = Console()
    console.print(table)
    console.print(f"report: {path}")
    return report
