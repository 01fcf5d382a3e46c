"""``run_up``: one round per policy against fresh engines; the report."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from stack.demo.config import DemoConfig, DemoError, Observer
from stack.demo.processes import Deployment, start_round, vllm_reuse_by_source
from stack.demo.summary import summarize
from stack.demo.workload import run_workload

logger = logging.getLogger("stack.demo")


def _router_metrics(router_url: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"{router_url}/metrics", timeout=5.0, trust_env=False)
        if r.status_code == 200:
            return r.text
    return None


def run_up(
    cfg: DemoConfig,
    *,
    observer: Observer | None = None,
    keep_logs: bool = False,
    hold: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the demo once per policy in ``cfg``, each against fresh engines; return the report.

    ``hold``: called with the report so far once the last policy's workload is done, while
    its engines and router are still up (``kvroute up --keep``); they stop when it returns.
    Raises :class:`DemoError` (logs kept) when the deployment fails to start or a request
    fails; children are stopped in every case, Ctrl-C included.
    """
    obs = observer or Observer()
    log_dir = Path(tempfile.mkdtemp(prefix="kvroute-up-"))
    rows: list[dict[str, Any]] = []
    pids: list[int] = []
    failed = True
    t_start = time.perf_counter()
    try:
        for n, policy in enumerate(cfg.policies, 1):
            dep = Deployment(log_dir)
            try:
                obs.round_started(policy, cfg.total_requests)
                obs.phase(policy, f"starting {cfg.engines} engines and the router")
                router_url, engine_list = start_round(cfg, policy, dep)
                obs.stack_up(policy, router_url, [e.url for e in engine_list])
                obs.phase(policy, "running the workload")
                t0 = time.perf_counter()
                records = asyncio.run(
                    run_workload(router_url, cfg, lambda r, p=policy: obs.request_done(p, r))
                )
                wall = time.perf_counter() - t0
                row = summarize(policy, records, _router_metrics(router_url))
                if cfg.engine == "vllm":
                    # vLLM's responses carry only cached_tokens; its metrics split them.
                    by_source = vllm_reuse_by_source([e.url for e in engine_list])
                    row["gpu_hit_tokens"] = by_source.get("local_cache_hit", 0)
                    row["cpu_hit_tokens"] = by_source.get("external_kv_transfer", 0)
                row["workload_s"] = wall
                row["router"] = router_url
                row["engines"] = [e.url for e in engine_list]
                row["ports"] = list(dep.ports)
                row["records"] = [asdict(r) for r in records]
                rows.append(row)
                bad = [r for r in records if not r.ok]
                if bad:
                    raise DemoError(
                        f"[{policy}] {len(bad)} of {len(records)} requests failed; first: "
                        f"{bad[0].status} {bad[0].error}",
                        log_dir,
                    )
                if hold is not None and n == len(cfg.policies):
                    obs.phase(policy, "kept up")
                    live = [*pids, *(c.proc.pid for c in dep.children)]
                    hold(_report(cfg, rows, live, t_start, None))
            finally:
                obs.phase(policy, "shutting down")
                pids += [c.proc.pid for c in dep.children]
                dep.stop(cfg.stop_timeout_s)
                obs.phase(policy, "stopped")
        failed = False
    finally:
        if failed or keep_logs:
            logger.warning("child process logs kept in %s", log_dir)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    return _report(cfg, rows, pids, t_start, str(log_dir) if keep_logs else None)


def _report(
    cfg: DemoConfig,
    rows: list[dict[str, Any]],
    pids: list[int],
    t_start: float,
    log_dir: str | None,
) -> dict[str, Any]:
    config = cfg.model_dump()
    config["policies"] = list(cfg.policies)
    return {
        "config": config,
        "rows": rows,
        "pids": pids,
        "wall_s": time.perf_counter() - t_start,
        "log_dir": log_dir,
    }
