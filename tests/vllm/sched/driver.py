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
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Any

import torch
import vllm
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


def build(job: dict[str, Any]) -> tuple[Scheduler, Any, list[Any]]:
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


def run(job: dict[str, Any]) -> dict[str, Any]:
    sched, hasher, published = build(job)
    token = job["sampled_token"]
    results = []
    for i, spec in enumerate(job["requests"]):
        req = Request(
            f"r{i}",
            spec["prompt_token_ids"],
            SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True),
            None,
            block_hasher=hasher,
        )
        sched.add_request(req)
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


if __name__ == "__main__":
    print(json.dumps(run(json.load(sys.stdin))))
