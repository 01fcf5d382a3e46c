"""The CUDA paths in one short run, for a machine with an NVIDIA GPU (CI has none).

``python -m bench.cuda_check OUT``: the offload tier's multi-group chunk copies between the
canonical KV tensors (one ``(num_blocks, page_bytes)`` tensor per group on the device) and
pinned host chunks, through ``TransferEngine``'s CUDA path (gather/scatter kernel + one PCIe
copy per host run on a side stream), against one plain copy of the same bytes, for each
profile, page size and blocks per chunk; each cell also checks one scattered page comes
back byte-exact. Writes ``OUT/cuda-copies.json`` and ``OUT/cuda-copies.md``.
``scripts/cuda-check.sh`` runs this after the engine tests' CUDA cases.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.offload import bench_copies

logger = logging.getLogger(__name__)

PROFILES = ("full", "swa-hybrid", "mamba-hybrid")
PAGE_BYTES = (64 * 1024, 512 * 1024, 2 * 1024 * 1024)
BLOCKS_PER_CHUNK = (1, 4)


def sweep(num_blocks: int = 512, repeats: int = 9) -> dict[str, Any]:
    """One ``bench_copies`` cell per (profile, page size, blocks per chunk) on CUDA."""
    if not torch.cuda.is_available():
        raise SystemExit("bench.cuda_check needs a CUDA device")
    dev = torch.device("cuda")
    cells = []
    for profile in PROFILES:
        for page in PAGE_BYTES:
            for k in BLOCKS_PER_CHUNK:
                t0 = time.perf_counter()
                cell: dict[str, Any] = {
                    "profile": profile,
                    "page_bytes": page,
                    "blocks_per_chunk": k,
                }
                r = bench_copies(**cell, num_blocks=num_blocks, repeats=repeats, device=dev)
                cells.append({**cell, **r})
                logger.info("%s done in %.1fs", cell, time.perf_counter() - t0)
                torch.cuda.empty_cache()
    return {
        "gpu": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "num_blocks": num_blocks,
        "repeats": repeats,
        "cells": cells,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# CUDA chunk copies ({report['gpu']}, torch {report['torch']}, CUDA {report['cuda']})",
        "",
        f"{report['num_blocks']} scattered device blocks per group per transfer, median of "
        f"{report['repeats']} interleaved with a plain contiguous copy of the same bytes.",
        "",
        "| profile | page KiB | blocks/chunk | MiB/transfer | store GB/s (plain) | ratio "
        "| load GB/s (plain) | ratio | byte-exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cells"]:
        st, ld = c["directions"]["store GPU->CPU"], c["directions"]["load CPU->GPU"]
        lines.append(
            f"| {c['profile']} | {c['page_bytes'] // 1024} | {c['blocks_per_chunk']} "
            f"| {c['bytes_per_transfer'] / 2**20:.0f} "
            f"| {st['ours_gbps']:.1f} ({st['plain_gbps']:.1f}) | {st['ratio']:.2f} "
            f"| {ld['ours_gbps']:.1f} ({ld['plain_gbps']:.1f}) | {ld['ratio']:.2f} "
            f"| {c['byte_exact']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(argv[1] if len(argv) > 1 else "bench-results/cuda")
    out.mkdir(parents=True, exist_ok=True)
    report = sweep()
    (out / "cuda-copies.json").write_text(json.dumps(report, indent=1))
    (out / "cuda-copies.md").write_text(markdown(report))
    sys.stdout.write(markdown(report))


if __name__ == "__main__":
    main(sys.argv)
