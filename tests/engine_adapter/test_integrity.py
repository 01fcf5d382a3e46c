"""Data integrity: a block loaded back from the CPU tier holds exactly the stored bytes."""

from __future__ import annotations

import random
import threading
import zlib

import numpy as np
import pytest
import torch
from ea_helpers import tokens

import engine_adapter.offload.transfer as transfer_mod
from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.offload import OffloadConfig
from engine_adapter.offload.transfer import GroupCopy, TransferEngine, coalesce
from engine_adapter.profiles import get_profile
from engine_adapter.request import Request

BS = 16
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def test_coalesce_merges_runs_on_both_sides() -> None:
    assert coalesce([3, 4, 5, 9, 10], [0, 1, 2, 4, 5]) == [(3, 0, 3), (9, 4, 2)]
    assert coalesce([1, 2], [5, 7]) == [(1, 5, 1), (2, 7, 1)]
    assert coalesce([], []) == []


def test_run_starts_finds_the_runs_coalesce_finds() -> None:
    """The CUDA path counts runs in NumPy (``_run_starts``); it must agree with ``coalesce``."""
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 40)
        src = sorted(rng.sample(range(80), n)) if rng.random() < 0.5 else rng.sample(range(80), n)
        dst = list(range(n)) if rng.random() < 0.5 else rng.sample(range(80), n)
        starts, lengths = transfer_mod._run_starts(np.asarray(src), np.asarray(dst))
        got = [(src[i], dst[i], k) for i, k in zip(starts.tolist(), lengths.tolist(), strict=True)]
        assert got == coalesce(src, dst)


@pytest.mark.parametrize("device", DEVICES)
def test_transfer_roundtrip_preserves_random_pages_per_group(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    gpu = [
        torch.randint(0, 256, (32, p), dtype=torch.uint8, generator=gen).to(device)
        for p in (64, 96)
    ]
    original = [t.clone() for t in gpu]
    pin = device == "cuda"
    cpu = [torch.zeros((16, p), dtype=torch.uint8, pin_memory=pin) for p in (64, 96)]
    engine = TransferEngine(gpu, cpu)
    rng = random.Random(0)
    src = [rng.sample(range(32), 12) for _ in gpu]
    rows = [rng.sample(range(16), 12) for _ in gpu]
    engine.submit(1, "store", [GroupCopy(g, src[g], rows[g]) for g in range(2)])
    assert engine.wait([1]) == [1]
    for t in gpu:
        t.zero_()
    dst = [rng.sample(range(32), 12) for _ in gpu]
    engine.submit(2, "load", [GroupCopy(g, dst[g], rows[g]) for g in range(2)])
    engine.wait_all()
    for g in range(2):
        for s, d in zip(src[g], dst[g], strict=True):
            assert torch.equal(gpu[g][d], original[g][s])
    engine.close()


class Compute:
    """Stands in for the model: writes each full block's KV as a function of its hash,
    and checks blocks the cache claims to hold (hits and loads) against that function."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.checked = 0

    def page(self, g: int, wire: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((wire ^ (g * 0x9E3779B97F4A7C15)) & (2**63 - 1))
        size = self.kv.profile.page_bytes[g]
        return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)

    def verify_prefix(self, req: Request, num_tokens: int) -> None:
        """Every held block of the reused prefix must carry its hash's bytes."""
        for g, ids in enumerate(self.kv.get_block_ids(req)):
            for i, bid in enumerate(ids[: num_tokens // BS]):
                if bid is None:
                    continue
                got = self.kv.gpu_kv[g][bid].cpu()
                want = self.page(g, req.wire_hashes[i])
                assert zlib.crc32(got.numpy().tobytes()) == zlib.crc32(want.numpy().tobytes())
                assert torch.equal(got, want), (g, i)
                self.checked += 1

    def run(self, req: Request) -> None:
        """Write the KV of everything computed so far (full blocks) and scribble on the
        partial tail (a running Mamba state changes every step)."""
        full = req.num_computed_tokens // BS
        for g, ids in enumerate(self.kv.get_block_ids(req)):
            for i, bid in enumerate(ids):
                if bid is None:
                    continue
                tensor = self.kv.gpu_kv[g]
                if i < full:
                    page = self.page(g, req.wire_hashes[i])
                else:
                    page = torch.randint(0, 256, (tensor.shape[1],), dtype=torch.uint8)
                tensor[bid] = page.to(tensor.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("profile", ["full", "swa-hybrid", "mamba-hybrid"])
def test_blocks_loaded_from_cpu_match_stored_bytes(profile: str, policy: str, device: str) -> None:
    prof = get_profile(profile, sliding_window=48, page_bytes=(128, 192)[: 1 + (profile != "full")])
    cfg = OffloadConfig(num_cpu_chunks=48, blocks_per_chunk=2, policy=policy)
    kv = KVCacheManager(prof, 20 * prof.num_groups, offload=cfg, device=device)
    compute = Compute(kv)
    mamba = profile == "mamba-hybrid"

    def step() -> None:
        kv.step_events()
        kv.new_step_starts()

    rng = random.Random(zlib.crc32(f"{profile}/{policy}".encode()))
    prefixes = [tokens(rng, rng.choice((96, 128, 160))) for _ in range(4)]
    cpu_hits = 0
    for n in range(40):
        prompt = [*rng.choice(prefixes), *tokens(rng, rng.randrange(1, 20))]
        req = kv.new_request(f"r{n}", prompt)
        gpu, cpu = kv.lookup(req)
        start = min(gpu + cpu, req.num_tokens - 1)
        # Mamba ("align" mode): vLLM's scheduler ends a prompt chunk at its replay
        # boundary floor((P - 1) / B) * B, the only state it keeps cached.
        boundary = (req.num_tokens - 1) // BS * BS
        cut = mamba and start < boundary
        todo = (boundary if cut else req.num_tokens) - start
        if not kv.allocate_slots(req, todo, gpu, cpu):
            continue
        cpu_hits += cpu > 0
        compute.verify_prefix(req, gpu + cpu)
        compute.run(req)
        step()
        if cut:
            assert kv.allocate_slots(req, req.num_tokens - boundary)
            compute.run(req)
            step()
        for _ in range(rng.randrange(0, 20)):
            req.append_output_token_ids(rng.randrange(1000))
            if not kv.allocate_slots(req, 1):
                break
            compute.run(req)
            step()
        kv.free(req)
        if rng.random() < 0.5:
            kv.flush()
    assert cpu_hits > 3 and compute.checked > 100
    kv.close()


def test_store_copy_finishes_before_its_source_block_is_reused(monkeypatch) -> None:
    prof = get_profile("full", page_bytes=512)
    kv = KVCacheManager(  # 8 usable blocks + the null block
        prof, 9, offload=OffloadConfig(num_cpu_chunks=8, blocks_per_chunk=4), device="cpu"
    )
    compute = Compute(kv)
    gate = threading.Event()
    real_copy = transfer_mod._copy_runs

    def slow_copy(runs):  # the copy engine is busy elsewhere for a while
        assert gate.wait(5)
        real_copy(runs)

    monkeypatch.setattr(transfer_mod, "_copy_runs", slow_copy)
    rng = random.Random(0)
    prompt = tokens(rng, 128)
    a = kv.new_request("a", prompt)
    assert kv.allocate_slots(a, 128)
    compute.run(a)
    kv.step_events()  # store submitted; its copy is stuck behind the gate
    kv.free(a)
    timer = threading.Timer(0.2, gate.set)
    timer.start()
    b = kv.new_request("b", tokens(rng, 128))
    assert kv.allocate_slots(b, 128)  # reuses a's blocks: must wait for the copy first
    assert kv.offload.stats["store_flushes"] >= 1
    compute.run(b)  # overwrite the reused pages
    kv.free(b)
    c = kv.new_request("c", tokens(rng, 128))
    assert kv.allocate_slots(c, 128)
    compute.run(c)
    kv.free(c)
    again = kv.new_request("a2", prompt)
    # a's chunks are still in flight (no step has ended since): a hit that must wait.
    assert kv.lookup(again) == (0, 128) and kv.cpu_hit_must_wait(again, 0, 128)
    kv.flush()
    kv.step_events()
    gpu, cpu = kv.lookup(again)
    assert (gpu, cpu) == (0, 128) and not kv.cpu_hit_must_wait(again, gpu, cpu)
    assert kv.allocate_slots(again, 1, gpu, cpu)
    compute.verify_prefix(again, 128)
    assert compute.checked == 8
    timer.join()
    kv.close()


def test_split_spreads_rows_over_workers_without_losing_any() -> None:
    from engine_adapter.offload.transfer import _split

    src = np.arange(40 * 4, dtype=np.uint8).reshape(40, 4)
    runs = [(src, src, 0, 10, 7), (src, src, 20, 0, 1), (src, src, 30, 30, 8)]
    for parts in (1, 2, 3, 5, 16):
        split = _split(runs, parts)
        assert len(split) <= parts
        rows = [(s + i, d + i) for part in split for _, _, s, d, n in part for i in range(n)]
        assert rows == [(s + i, d + i) for _, _, s, d, n in runs for i in range(n)]
        sizes = [sum(r[4] for r in part) for part in split]
        assert max(sizes) - min(sizes) <= max(1, 16 // parts)
