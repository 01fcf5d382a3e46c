"""Drive vLLM's own ``Scheduler`` and KV cache manager in-process, with canned outputs.

Runs under vLLM's interpreter (the 0.32 CPU venv; for 0.33, that venv with 0.33's Python
sources first on ``PYTHONPATH`` and ``VLLM_TARGET_DEVICE=cpu``), never the project's. No
model runs: each step's ``ModelRunnerOutput`` samples ``sampled_token`` for every request
whose prompt is computed, as vLLM's own scheduler tests do. The config is built the way the
engine core builds it, so block sizes, hash block size and cache-hit alignment are vLLM's.

stdin: one JSON object -- ``model_dir``, ``block_size``, ``budget``, ``num_blocks``,
``max_model_len``, ``sampled_token`` and ``requests`` (``prompt_token_ids``, ``max_tokens``),
served one after another. stdout (last line): JSON with vLLM's version, its block sizes and,
per request, the prefix hit (``cached``) and the KV events published while it ran, as
``[type, group_idx, hash]`` rows.

``offload`` (optional): vLLM's ``OffloadingConnector`` with its own ``CPUOffloadingSpec``
(``kv_connector_extra_config``: ``cpu_bytes_to_use``, ``blocks_per_chunk``,
``eviction_policy``, ``self_describing_kv_events``). Its scheduler side -- lookups, store
jobs, ``CPUOffloadingManager`` with LRU / ARC, the CPU events -- is vLLM's, unchanged. Its
worker side is vLLM's ``OffloadingConnectorWorker`` called in the model runner's order
(``handle_preemptions``, ``start_load_kv``, ``wait_for_save``, ``get_finished``,
``build_connector_worker_meta``) over a worker that copies nothing and reports each job
done at the first poll after submission: a store offered at step N completes in step N+1
(submitted at its start), a load in its own step, as the host worker on a server does.
Then each request also reports ``cpu`` (its external tokens, vLLM's ``prefill_stats``),
the result ``num_chunks``, and requests may carry ``reset`` (``reset_prefix_cache``
before it, ``reset_connector`` as vLLM's ``reset_external``).

``{"jobs": [...]}`` runs several jobs in one process (importing vLLM is most of the cost).
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import torch
import vllm
from rows import offload_rows  # this script's folder is on sys.path
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MAX_STEPS_PER_REQUEST = 10_000


def _kv_cache_configs(cfg: Any, specs: dict[str, Any]) -> list[Any]:
    """0.33 moved the planner to ``kv_cache_planning`` and wants the global groups."""
    fn = getattr(kv_cache_utils, "get_kv_cache_configs", None)
    if fn is None:
        from vllm.v1.core import kv_cache_planning

        fn = kv_cache_planning.get_kv_cache_configs
    if "global_kv_cache_groups" in inspect.signature(fn).parameters:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

        return fn(cfg, [specs], [1 << 34], get_global_kv_cache_groups(cfg, [specs]))
    return fn(cfg, [specs], [1 << 34])


def _layer_specs(cfg: Any, layout: str, block_size: int) -> dict[str, Any]:
    """Per-layer KV cache specs as a model's layers would report them; vLLM groups them.

    ``full``: one attention layer (Llama-like). ``mamba``: three linear-attention (Mamba,
    "align" mode) layers and one attention layer, state page = attention page
    (Qwen3-Next-like: groups 0-2 Mamba, 3 full). ``swa``: five 64-token sliding-window
    layers and one full (Gemma-3-like: groups 0-4 window, 5 full).
    """
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    shape = {"num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    full = FullAttentionSpec(block_size=block_size, **shape)  # type: ignore[arg-type]
    if layout == "full":
        return {"model.layers.0.self_attn.attn": full}
    if layout == "mamba":
        cfg.cache_config.mamba_cache_mode = "align"
        cfg.cache_config.mamba_block_size = block_size
        state = MambaSpec(
            block_size=block_size,
            shapes=((full.page_size_bytes // 4,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
        )
        specs = {f"model.layers.{i}.linear_attn": state for i in range(3)}
        return {**specs, "model.layers.3.self_attn.attn": full}
    if layout == "swa":
        window = SlidingWindowSpec(block_size=block_size, sliding_window=64, **shape)  # type: ignore[arg-type]
        specs = {f"model.layers.{i}.self_attn.attn": window for i in range(5)}
        return {**specs, "model.layers.5.self_attn.attn": full}
    raise ValueError(f"unknown layout {layout!r}")


class _DoneAtFirstPoll:
    """An ``OffloadingWorker`` without copies: every job submitted is finished at the
    next ``get_finished``."""

    def __init__(self) -> None:
        self.submitted: list[int] = []

    def submit_store(self, job_id: int, *args: Any, **kwargs: Any) -> bool:
        self.submitted.append(job_id)
        return True

    submit_load = submit_store

    def get_finished(self) -> list[Any]:
        from vllm.v1.kv_offload.base import TransferResult

        done, self.submitted = self.submitted, []
        return [TransferResult(job_id, True) for job_id in done]

    def wait(self, job_ids: set[int]) -> None:
        return

    def shutdown(self) -> None:
        return


def _offload_worker(cfg: Any, kv_config: Any) -> Any:
    """vLLM's worker-side connector over :class:`_DoneAtFirstPoll`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    conn = OffloadingConnector(cfg, KVConnectorRole.WORKER, kv_config)
    assert conn.connector_worker is not None
    conn.connector_worker.worker = _DoneAtFirstPoll()
    return conn.connector_worker


def _worker_step(worker: Any, out: Any) -> Any:
    """The model runner's connector calls for one step; returns the KVConnectorOutput."""
    from vllm.v1.outputs import KVConnectorOutput

    meta = out.kv_connector_metadata
    worker.handle_preemptions(meta)
    worker.start_kv_transfers(meta)
    worker.prepare_store_kv(meta)
    sending, recving = worker.get_finished(out.finished_req_ids)
    return KVConnectorOutput(
        finished_sending=sending or None,
        finished_recving=recving or None,
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )


def build(job: dict[str, Any]) -> tuple[Scheduler, Any, list[Any]]:
    offload = job.get("offload")
    extra: dict[str, Any] = {}
    if offload:
        from vllm.config import KVTransferConfig

        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(offload),
        )
    args = EngineArgs(
        model=job["model_dir"],
        enable_prefix_caching=True,
        block_size=job["block_size"],
        max_num_batched_tokens=job["budget"],
        max_model_len=job["max_model_len"],
        enforce_eager=True,
        prefix_caching_hash_algo="sha256_cbor",
        num_gpu_blocks_override=job["num_blocks"],
        kv_events_config={"enable_kv_cache_events": True, "publisher": "null"},
        **extra,
    )
    cfg = args.create_engine_config()
    specs = _layer_specs(cfg, job.get("layout", "full"), job["block_size"])
    resolve_kv_cache_layout(cfg, [["NHD", "LBNHC", "HND", "LBHNC"]], list(specs.values()))
    kv_config = kv_cache_utils.generate_scheduler_kv_cache_config(_kv_cache_configs(cfg, specs))
    cfg.cache_config.num_gpu_blocks = kv_config.num_blocks
    sched_bs, hash_bs = kv_cache_utils.resolve_kv_cache_block_sizes(kv_config, cfg)
    kv_config.hash_block_size = hash_bs
    kv_config.cache_hit_alignment_tokens = kv_cache_utils.resolve_cache_hit_alignment_tokens(
        kv_config, cfg, sched_bs, hash_bs
    )
    sched = Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=sched_bs,
        hash_block_size=hash_bs,
    )
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(hash_bs, hash_fn)
    published: list[Any] = []
    sched.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
    sched.offload_worker = _offload_worker(cfg, kv_config) if offload else None  # type: ignore[attr-defined]
    return sched, hasher, published


def _rows(batches: list[Any]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for batch in batches:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                rows.append(["stored_event", ev.group_idx, None])
            rows += [[kind, getattr(ev, "group_idx", None), h] for h in ev.block_hashes or ()]
            if kind == "AllBlocksCleared":
                rows.append([kind, None, None])
    return rows


def _step(sched: Scheduler, token: int, split: dict[str, tuple[int, int]]) -> Any:
    """One engine step: schedule, canned model output (+ the connector's worker side).
    ``split``: request id -> (GPU, CPU) hit tokens, from its first admission's stats."""
    out = sched.schedule()
    scheduled = out.num_scheduled_tokens
    for r in scheduled:
        stats = sched.requests[r].prefill_stats
        if r not in split and stats is not None and stats.num_prompt_tokens:
            split[r] = (stats.num_local_cached_tokens, stats.num_external_cached_tokens)
    ids = list(scheduled)
    sampled = [
        [token] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
        for r in ids
    ]
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: j for j, r in enumerate(ids)},
        sampled_token_ids=sampled,
    )
    worker = getattr(sched, "offload_worker", None)
    if worker is not None:
        runner.kv_connector_output = _worker_step(worker, out)
    sched.update_from_output(out, runner)
    return out


def _add_request(sched: Any, request_id: str, spec: dict[str, Any], hasher: Any) -> Any:
    """A ``Request`` for ``spec`` (prompt ids, max tokens; EOS ignored), added to ``sched``."""
    req = Request(
        request_id,
        spec["prompt_token_ids"],
        SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True),
        None,
        block_hasher=hasher,
    )
    sched.add_request(req)
    return req


def run(job: dict[str, Any]) -> dict[str, Any]:
    sched, hasher, published = build(job)
    if job.get("offload"):
        return _run_offload(job, sched, hasher, published)
    token = job["sampled_token"]
    results = []
    for i, spec in enumerate(job["requests"]):
        req = _add_request(sched, f"r{i}", spec, hasher)
        cached = None
        for _ in range(MAX_STEPS_PER_REQUEST):
            out = sched.schedule()
            scheduled = out.num_scheduled_tokens
            if cached is None and req.request_id in scheduled:
                cached = req.num_computed_tokens - scheduled[req.request_id]
            ids = list(scheduled)
            sampled = [
                [token]
                if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                else []
                for r in ids
            ]
            sched.update_from_output(
                out,
                ModelRunnerOutput(
                    req_ids=ids,
                    req_id_to_index={r: j for j, r in enumerate(ids)},
                    sampled_token_ids=sampled,
                ),
            )
            if req.is_finished():
                break
        else:
            raise RuntimeError(f"request {i} did not finish in {MAX_STEPS_PER_REQUEST} steps")
        # The events of a request's last step are taken at the next schedule(): one more.
        sched.update_from_output(
            sched.schedule(), ModelRunnerOutput(req_ids=[], req_id_to_index={})
        )
        results.append({"cached": cached, "events": _rows(published)})
        published.clear()
    return {
        "version": vllm.__version__,
        "block_size": sched.block_size,
        "hash_block_size": sched.hash_block_size,
        "results": results,
    }


def _run_offload(job: dict[str, Any], sched: Scheduler, hasher: Any, published: list[Any]) -> dict:
    """Requests one after another, each run until the connector has nothing left to do
    (its last chunks stored, their copies reported), as the server differential waits."""
    token = job["sampled_token"]
    results = []
    split: dict[str, tuple[int, int]] = {}
    for i, spec in enumerate(job["requests"]):
        if spec.get("reset"):
            assert sched.reset_prefix_cache(reset_connector=spec["reset"] == "external")
            continue
        req = _add_request(sched, f"r{i}", spec, hasher)
        for _ in range(MAX_STEPS_PER_REQUEST):
            _step(sched, token, split)
            if req.is_finished():
                break
        else:
            raise RuntimeError(f"request {i} did not finish in {MAX_STEPS_PER_REQUEST} steps")
        for _ in range(64):
            _step(sched, token, split)
            if not sched.connector.has_pending_push_work():
                break
        _step(sched, token, split)  # events of the last step are taken at the next one
        gpu, cpu = split[req.request_id]
        results.append(
            {
                "cached": gpu + cpu,
                "cpu": cpu,
                "preemptions": req.num_preemptions,
                "events": offload_rows(published),
            }
        )
        published.clear()
    manager = sched.connector.connector_scheduler.manager
    return {
        "version": vllm.__version__,
        "block_size": sched.block_size,
        "hash_block_size": sched.hash_block_size,
        "num_chunks": manager._num_chunks,
        "results": results,
    }


def main() -> None:
    """One job, or ``{"jobs": [...]}``: several in one process (vLLM imports once)."""
    job = json.load(sys.stdin)
    if "jobs" in job:
        print(json.dumps({"results": [run(j) for j in job["jobs"]]}))
    else:
        print(json.dumps(run(job)))


if __name__ == "__main__":
    main()
