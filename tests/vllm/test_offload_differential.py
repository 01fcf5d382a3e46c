"""Differential test of the CPU tier: the simulated engine against vLLM's real connector.

Why: every benchmark, the demo and the policy work measure CPU-tier reuse on the simulated
engine; if its offload tier is not vLLM's ``OffloadingConnector``, those numbers are wrong.
The same sequential stream goes to a real vLLM with the connector (our host-memory spec,
``engine_adapter.vllm_cpu.offload_spec``) and to our ``EngineCore`` with the same layout,
block size, GPU pool, chunk budget, CPU tier size (vLLM's own ``num_chunks``, read from the
spec's log line), blocks per chunk, policy and event mode. After every request both must
report the same ``cached_tokens`` split into GPU and CPU (vLLM:
``vllm:prompt_tokens_by_source_total``) and must have published the same multiset of
(type, medium, group, hash) entries -- CPU stores and removals included -- ignoring order
and batch placement.

Cells: one server per (model, blocks per chunk, policy, event mode, chunk budget), a
covering subset rather than the cross product (each start costs ~30 s in CI). The stream
has cold prompts, extensions, branches at and inside earlier prompts, repeats after the
GPU pool evicted them (CPU hits), a CPU tier small enough to evict, and
``POST /reset_prefix_cache`` with and without ``reset_external``. One cell holds copies in
flight (the spec's ``kvroute_hold_polls``, our ``copy_delay_steps``) and ends with a burst
of concurrent requests on a prefix only the CPU tier holds (see ``_burst``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from harness import CpuOffload, EventRecorder, VllmServer, bind_mode_config
from harness import free_port as harness_free_port
from simkit import CPU_DEFAULT_BUDGET, offload_config, serve_cell, sim_engine
from simkit import tally as tally_events
from workload import FORCED_TOKEN, SAMPLING

from engine_adapter.profiles import get_profile
from engine_adapter.sim.core import EngineCore
from events.structs import BlockStored, KVEventBatch

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;:"


@dataclass(frozen=True)
class Cell:
    model: str
    layout: str
    block_size: int  # what vLLM uses (asserted from its events)
    vllm_block_size: int | None  # --block-size given to vLLM
    num_gpu_blocks: int
    max_model_len: int
    chunk_budget: int | None  # --max-num-batched-tokens; None: vLLM's CPU default
    blocks_per_chunk: int
    policy: str
    self_describing: bool
    cpu_chunks: int  # target; vLLM's own count is read back from its log
    kv_bytes_per_block: int  # to size cpu_bytes_to_use for ``cpu_chunks``
    doc_len: tuple[int, int]
    n: int
    # Copies stay in flight this many worker polls (vLLM: the spec's ``kvroute_hold_polls``;
    # ours: ``copy_delay_steps``), and the stream ends with a burst on a prefix only the
    # CPU tier holds (``burst``: concurrent requests on chunks still being copied).
    hold: int = 0
    burst: int = 0

    @property
    def name(self) -> str:
        mode = "selfdesc" if self.self_describing else "placeholder"
        held = f"-hold{self.hold}-burst{self.burst}" if self.hold or self.burst else ""
        return (
            f"{self.model}-bpc{self.blocks_per_chunk}-{self.policy}-{mode}-"
            f"budget{self.chunk_budget or 'default'}{held}"
        )


CELLS = [
    # Llama-like, block 32, budget == block size, vLLM's defaults (1 block/chunk, LRU,
    # placeholders); the CPU tier holds about two prompts.
    Cell("llama", "full", 32, 32, 24, 736, 32, 1, "lru", False, 48, 16384, (150, 330), 36),
    # Two blocks per chunk with vLLM's default placeholder events, ARC, budget above the
    # block size; copies held in flight two polls, and a closing burst of three requests
    # on a prefix only the CPU tier holds: the first loads it, the others wait for that
    # load and hit it on GPU.
    Cell(
        "llama",
        "full",
        32,
        32,
        24,
        736,
        256,
        2,
        "arc",
        False,
        24,
        16384,
        (150, 330),
        30,
        hold=2,
        burst=3,
    ),
    # Gemma-3-like: five window-64 groups + full attention at block 32, budget == block
    # size, two blocks per chunk, self-describing events (the full group's chunks name
    # both block hashes; the window groups keep placeholders).
    Cell("gemma3", "swa:64*5,full", 32, 16, 96, 1024, 32, 2, "lru", True, 75, 4096, (250, 600), 30),
    # Qwen3-Next-like: three Mamba groups + full attention. Block 128 (the harness keeps
    # the SSM state in bf16 on every machine, ``harness.MODEL_ARGS``); vLLM's default
    # chunk budget (the CPU build's 2048: whole prompts in one step).
    Cell(
        "qwen3next",
        "mamba*3,full",
        128,
        None,
        24,
        2048,
        None,
        1,
        "arc",
        False,
        60,
        32768,
        (500, 1300),
        24,
    ),
]


@dataclass
class Step:
    kind: str
    prompt: str = ""
    max_tokens: int = 2


def stream(seed: int, n: int, doc_len: tuple[int, int], limit: int) -> list[Step]:
    """Completions only (lengths under ``limit``): cold docs, repeats (after other docs
    pushed them out of the GPU pool: CPU hits), extensions, branches at the end of and
    inside earlier prompts, and GPU-only / full resets."""
    rng = random.Random(seed)
    docs: list[str] = []
    steps: list[Step] = []

    def text(k: int) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(k))

    kinds = ["cold", "repeat", "repeat_old", "extend", "branch_inside", "reset", "reset_external"]
    weights = [4, 2, 4, 3, 3, 0.6, 0.4]
    while len(steps) < n:
        kind = rng.choices(kinds, weights)[0] if len(docs) >= 2 else "cold"
        if kind == "cold":
            doc = text(rng.randint(*doc_len))
            docs.append(doc)
            steps.append(Step(kind, doc, rng.choice([1, 3])))
        elif kind == "repeat":
            steps.append(Step(kind, rng.choice(docs[-3:])))
        elif kind == "repeat_old":  # likely gone from the GPU pool, still on CPU
            steps.append(Step(kind, rng.choice(docs[-7:-2] or docs)))
        elif kind == "extend":
            doc = rng.choice(docs[-4:])
            ext = doc + text(rng.randint(10, 200))
            ext = ext[: limit - 8]
            docs.append(ext)
            steps.append(Step(kind, ext))
        elif kind == "branch_inside":
            doc = rng.choice(docs[-4:])
            cut = rng.randint(len(doc) // 4, max(len(doc) // 4, len(doc) - 20))
            steps.append(Step(kind, (doc[:cut] + text(rng.randint(20, 200)))[: limit - 8]))
        else:
            steps.append(Step(kind))
    return steps


def tally(batches: list[KVEventBatch]) -> Counter[tuple[Any, ...]]:
    """(type, medium, group, hash) per stored / removed hash, BlockStored events per
    (medium, group), other event types, and the shape of every CPU BlockStored."""
    out = tally_events(batches, lambda ev: (ev.medium, ev.group_idx))
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored) and ev.medium == "CPU":
                shape = (len(ev.block_hashes), len(ev.token_ids), ev.block_size)
                out[("cpu_shape", ev.group_idx, *shape)] += 1
    return out


def cpu_part(t: Counter[tuple[Any, ...]]) -> Counter[tuple[Any, ...]]:
    return Counter({k: v for k, v in t.items() if "CPU" in k or k[0] == "cpu_shape"})


@dataclass
class Row:
    kind: str
    vllm: tuple[int, int]  # (GPU, CPU) tokens
    ours: tuple[int, int]
    events_equal: bool
    cpu_events_equal: bool


NUM_CHUNKS_RE = re.compile(r"kvroute offload tier: num_chunks=(\d+)")


def vllm_num_chunks(server: VllmServer, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        found = NUM_CHUNKS_RE.findall(server.log_tail(10**7))
        if found:
            return int(found[-1])
        if time.monotonic() > deadline:
            raise AssertionError("the spec never logged vLLM's num_chunks")
        time.sleep(0.2)


async def _ours(core: EngineCore, rid: str, ids: list[int], max_tokens: int) -> tuple[int, int]:
    gpu = cpu = 0
    async for out in core.submit(rid, ids, max_tokens, forced_token=FORCED_TOKEN):
        gpu, cpu = out.gpu_hit_tokens, out.cpu_hit_tokens
    deadline = time.monotonic() + 10
    while core.kv.has_pending_work and time.monotonic() < deadline:
        await asyncio.sleep(0.005)  # copies in flight: their events come out as it steps
    return gpu, cpu


def _doc(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


async def _burst(
    cell: Cell,
    server: VllmServer,
    core: EngineCore,
    rec: EventRecorder,
    captured: Any,
    sent: int,
    rng: random.Random,
) -> Row:
    """A prefix stored on CPU, the GPU tier reset (vLLM's default reset keeps the CPU
    tier), then ``cell.burst`` requests extending it sent together: the first looked up
    loads it from the CPU tier; the others find its chunks being loaded -- vLLM defers
    them (``OffloadingConnectorScheduler._lookup_complete_chunks``: "Delaying request
    since some of its chunks are already being loaded") -- or, arriving later, loaded: they
    hit it on GPU. The reset leaves the GPU pool free, so no eviction depends on when each
    request arrives. Which request comes first is the scheduler's arrival order, so the
    engines are compared on the sorted per-request hits, the burst's GPU / CPU split and
    the events. Returns one row for the whole burst."""
    prefix = _doc(rng, 300)
    res = await asyncio.to_thread(server.complete, prefix, 1, **SAMPLING)
    sent += res.prompt_tokens
    await _ours(core, "prefix", list(prefix.encode()), 1)
    want = tally(captured.batches)
    await asyncio.to_thread(rec.wait_until, lambda recs: tally([r.batch for r in recs]) == want, 10)
    assert await asyncio.to_thread(server.reset_prefix_cache, False)
    assert core.reset_prefix_cache(False)
    before = await asyncio.to_thread(server.wait_prompt_tokens, sent)
    prompts = [prefix + _doc(rng, rng.randint(20, 60)) for _ in range(cell.burst)]
    results = await asyncio.gather(
        *(asyncio.to_thread(server.complete, p, 2, **SAMPLING) for p in prompts)
    )
    sent += sum(r.prompt_tokens for r in results)
    after = await asyncio.to_thread(server.wait_prompt_tokens, sent)
    v_split = (
        after.get("local_cache_hit", 0) - before.get("local_cache_hit", 0),
        after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0),
    )
    ours = await asyncio.gather(
        *(_ours(core, f"burst{i}", list(p.encode()), 2) for i, p in enumerate(prompts))
    )
    o_split = (sum(g for g, _ in ours), sum(c for _, c in ours))
    v_hits = sorted(r.cached_tokens for r in results)
    o_hits = sorted(g + c for g, c in ours)
    want = tally(captured.batches)
    try:
        await asyncio.to_thread(
            rec.wait_until, lambda recs: tally([r.batch for r in recs]) == want, 10
        )
        same = True
    except TimeoutError:
        got = tally([r.batch for r in rec.batches()])
        same = False
        log.error("burst: events differ; vLLM-only %s; ours-only %s", got - want, want - got)
    log.info(
        "burst of %d: hits vLLM %s ours %s; split vLLM gpu %d cpu %d | ours gpu %d cpu %d",
        cell.burst, v_hits, o_hits, *v_split, *o_split,
    )  # fmt: skip
    assert v_split[1] > 0, "the burst's prefix was not served from the CPU tier"
    assert v_split[0] > 0, "no request of the burst hit the loaded prefix on GPU"
    if v_hits != o_hits:
        o_split = (-1, -1)  # a Row compares splits: make the difference count
    return Row("burst", v_split, o_split, same, same)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("cell", CELLS, ids=[c.name for c in CELLS])
async def test_offload_tier_matches_vllm_connector_request_by_request(
    cell: Cell, vllm_server: Any, event_recorder: Any
) -> None:
    cfg = bind_mode_config(f"offdiff-{harness_free_port()}", replay_port=harness_free_port())
    rec: EventRecorder = event_recorder(cfg)
    # Size the tier so vLLM's num_chunks is about ``cpu_chunks`` (4 KiB alignment).
    per_block = cell.kv_bytes_per_block or 4096
    per_chunk = -(-per_block * cell.blocks_per_chunk // 4096) * 4096
    offload = CpuOffload(
        cell.cpu_chunks * per_chunk,
        blocks_per_chunk=cell.blocks_per_chunk,
        eviction_policy=cell.policy,
        self_describing_kv_events=cell.self_describing,
        hold_polls=cell.hold,
    )
    server: VllmServer = await asyncio.to_thread(
        serve_cell, vllm_server, cell, cfg, cell.max_model_len,
        cpu_offload=offload, dev_mode=True,
        timeout=900,  # start-up is minutes on a loaded 2-core machine
    )  # fmt: skip
    num_chunks = vllm_num_chunks(server)
    log.info("%s: vLLM's CPU tier has %d chunks", cell.name, num_chunks)
    assert num_chunks > 0
    core, captured = sim_engine(
        get_profile(cell.model, layout=cell.layout, block_size=cell.block_size, page_bytes=64),
        cell.num_gpu_blocks,
        cell.chunk_budget or CPU_DEFAULT_BUDGET,
        cell.max_model_len,
        # The CPU build serves 0.32; its connector is what this suite checks.
        offload=offload_config(cell, num_chunks, copy_delay_steps=cell.hold, vllm_version="0.32"),
    )
    await core.start()
    steps = stream(7, cell.n, cell.doc_len, cell.max_model_len)
    rows: list[Row] = []
    sent = 0
    before = await asyncio.to_thread(server.wait_prompt_tokens, 0)
    try:
        for i, step in enumerate(steps):
            if step.kind.startswith("reset"):
                external = step.kind == "reset_external"
                ok_v = await asyncio.to_thread(server.reset_prefix_cache, external)
                ok_o = core.reset_prefix_cache(external)
                assert ok_v and ok_o, (ok_v, ok_o)
                log.info("%2d %s", i, step.kind)
                continue
            ids = list(step.prompt.encode())
            res = await asyncio.to_thread(server.complete, step.prompt, step.max_tokens, **SAMPLING)
            assert res.prompt_token_ids in (None, ids), "tokenizers disagree"
            sent += res.prompt_tokens
            after = await asyncio.to_thread(server.wait_prompt_tokens, sent)
            v_gpu = after.get("local_cache_hit", 0) - before.get("local_cache_hit", 0)
            v_cpu = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            before = after
            assert v_gpu + v_cpu == res.cached_tokens
            ours = await _ours(core, f"r{i}", ids, step.max_tokens)
            want = tally(captured.batches)
            try:
                await asyncio.to_thread(
                    rec.wait_until,
                    lambda recs, w=want: tally([r.batch for r in recs]) == w,
                    10,
                )
                same = same_cpu = True
            except TimeoutError:
                got = tally([r.batch for r in rec.batches()])
                same = False
                same_cpu = cpu_part(got) == cpu_part(want)
                log.error(
                    "request %d (%s): events differ; vLLM-only %s; ours-only %s",
                    i,
                    step.kind,
                    dict(got - want),
                    dict(want - got),
                )
            rows.append(Row(step.kind, (v_gpu, v_cpu), ours, same, same_cpu))
            log.info(
                "%2d %-13s prompt %4d vLLM gpu %4d cpu %4d | ours gpu %4d cpu %4d | events %s",
                i,
                step.kind,
                len(ids),
                v_gpu,
                v_cpu,
                *ours,
                "=" if same else ("CPU=" if same_cpu else "DIFFER"),
            )
            if not same:
                break  # later requests would differ by construction
        if cell.burst and len(rows) == sum(not s.kind.startswith("reset") for s in steps):
            burst = await _burst(cell, server, core, rec, captured, sent, rng=random.Random(9))
            rows.append(burst)
    finally:
        await core.stop()
    sizes = {e.block_size for e in rec.stored() if e.medium == "GPU"}
    assert sizes == {cell.block_size}, f"vLLM chose block size {sizes}"
    equal = sum(r.vllm == r.ours and r.events_equal for r in rows)
    cpu_hits = sum(r.vllm[1] > 0 for r in rows)
    cpu_removed = sum(1 for e in rec.removed() if e.medium == "CPU")
    log.info(
        "%s: equal %d/%d (split and events), CPU hits on %d/%d requests, CPU removals %d",
        cell.name,
        equal,
        len(rows),
        cpu_hits,
        len(rows),
        cpu_removed,
    )
    n_requests = sum(not s.kind.startswith("reset") for s in steps) + bool(cell.burst)
    assert len(rows) == n_requests, f"stopped at request {len(rows) - 1}: events differ"
    assert equal == len(rows), [r for r in rows if r.vllm != r.ours or not r.events_equal]
    # The stream must exercise what it claims: CPU hits and CPU evictions.
    assert cpu_hits > 0, "no request was served from the CPU tier"
    assert cpu_removed > 0, "the CPU tier was never small enough to evict"
