"""``kvroute bench fleet``: one router in front of a simulated fleet, end to end.

For each fleet size (default 96 and 256 instances), three processes besides this one
(``bench.fleet_procs``): the fleet's publishers (vLLM's ``ZmqEventPublisher`` per
instance, ``bench.fleet_workload``'s hybrid full-attention + sliding-window layout on GPU
and CPU tiers, millions of entries), the fleet's HTTP engines (answer at once), and the
real router (memory index) started cold after the fleet has published: it meets the
backlog through each publisher's replay. Measured, one run each:

* ingest: block events/s from ZMQ into the memory index (every instance's last seq
  applied; the index's entries must equal the workload's), and into Redis (a private
  ``redis-server``; the first ``redis_instances`` instances, a second router process,
  while the first idles after its proxy measurement);
* router RSS: at the start, after ingest, peak (``VmHWM``) -- and bytes per entry, the
  router's growth over ingest divided by the entries it holds;
* idle probe CPU: the router's CPU share over ``idle_s`` seconds with nothing to do but
  probe its instances' health (``/health``, ``/metrics``, models);
* decision time: ``Router.decide`` in the router process for ``prompt_tokens``-token
  prompts (the documents' shared part followed by a fresh tail: the common case of
  long-context traffic), every decision checked: the expected holder chosen and credited
  exactly the expected GPU and CPU tokens;
* added latency: the same requests through the router's proxy and straight to the
  engine (a fresh connection-pooled client, alternating), p50 difference;
* churn (``churn_minutes`` > 0): simulated minutes of cache churn, ``churn_rate`` block
  events per instance-second (stores of fresh prompts, evictions of the oldest: the index
  keeps its size), each minute published as fast as it goes -- an hour of a fleet's
  events in minutes; the router's RSS after each minute must stay flat, and the index
  must hold its entries again once churn is taken back.

The report goes to ``out/fleet.json``; ``kvroute bench fleet --small`` is the CI scale.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from bench.fleet_workload import FleetShape, instance_batches, queries

__all__ = ["TARGETS", "run"]

TARGETS = {
    "decision_p50_ms": {96: 8.0, 256: 15.0},
    "added_p50_ms": 20.0,
    "peak_rss_mb_at_5m": 1024.0,
    "ingest_memory_per_s": 1_000_000,
    "ingest_redis_per_s": 300_000,
    "idle_probe_cpu_share": 0.03,
}


class _Child:
    """A ``bench.fleet_procs`` process spoken to by lines."""

    def __init__(self, role: str, cfg: dict[str, Any], workdir: Path, log: IO[str]) -> None:
        path = workdir / f"{role}.json"
        path.write_text(json.dumps(cfg))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.fleet_procs", role, str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
        self.role = role

    def read(self, step: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.role} process ended before {step!r} (see its log)")
            with contextlib.suppress(json.JSONDecodeError):
                msg = json.loads(line)
                if isinstance(msg, dict) and msg.get("step") == step:
                    return msg

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("stop")
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def _children(workdir: Path, log: IO[str]) -> Iterator[list[_Child]]:
    kids: list[_Child] = []
    try:
        yield kids
    finally:
        for k in reversed(kids):
            k.close()


def _last_seqs(shape: FleetShape) -> tuple[list[int], int, int]:
    """Per instance the last seq it publishes; the fleet's entries and block events."""
    seqs, entries, blocks = [], 0, 0
    for i in range(shape.instances):
        batches, e, b = instance_batches(shape, i)
        seqs.append(len(batches) - 1)
        entries, blocks = entries + e, blocks + b
    return seqs, entries, blocks


def _proxy_latency(
    router_port: int, ports: list[int], shape: FleetShape, n: int, router_pid: int
) -> dict:
    """Alternate the same fresh requests through the router and straight to the engine
    that holds their document; p50 of each and the difference."""
    import httpx

    qs = queries(shape, n, salt="proxy")
    bodies = [
        json.dumps({"model": "kvroute-sim", "prompt": q.tokens, "max_tokens": 1}).encode()
        for q in qs
    ]
    from bench.replay.procs import cpu_seconds

    via, direct = [], []
    headers = {"content-type": "application/json"}
    cpu0 = cpu_seconds(router_pid)
    with httpx.Client(timeout=60) as client:
        for k, (q, body) in enumerate(zip(qs, bodies, strict=True)):
            targets = [(f"http://127.0.0.1:{router_port}", via),
                       (f"http://127.0.0.1:{ports[q.holder]}", direct)]  # fmt: skip
            if k % 2:
                targets.reverse()
            for base, out in targets:
                t0 = time.perf_counter()
                r = client.post(f"{base}/v1/completions", content=body, headers=headers)
                dt = time.perf_counter() - t0
                if r.status_code != 200:
                    raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.text[:200]}")
                if k >= 2:  # first requests open connections
                    out.append(dt)
    cpu = cpu_seconds(router_pid) - cpu0
    via_p50, direct_p50 = statistics.median(via), statistics.median(direct)
    return {
        "router_cpu_ms_per_request": cpu / len(qs) * 1e3,  # probes included
        "router_p50_ms": via_p50 * 1e3,
        "direct_p50_ms": direct_p50 * 1e3,
        "added_p50_ms": (via_p50 - direct_p50) * 1e3,
        "requests": len(via),
        "body_bytes": len(bodies[0]),
    }


def _fleet(
    shape: FleetShape, *, decisions: int, proxy_requests: int, idle_s: float, redis: bool,
    redis_instances: int, churn_minutes: int, churn_rate: float, workdir: Path, log: IO[str],
) -> dict[str, Any]:  # fmt: skip
    from stack.procs import free_port, ipc_endpoint

    n = shape.instances
    ports = [free_port() for _ in range(n)]
    tag = f"fleet{ports[0]}"
    events = [ipc_endpoint(f"{tag}-ev{i}") for i in range(n)]
    replays = [ipc_endpoint(f"{tag}-rp{i}") for i in range(n)]
    t0 = time.perf_counter()
    last_seqs, want_entries, want_blocks = _last_seqs(shape)
    out: dict[str, Any] = {
        "instances": n,
        "entries_expected": want_entries,
        "block_events": want_blocks,
        "batches": sum(s + 1 for s in last_seqs),
    }
    base = {"shape": shape.to_dict(), "ports": ports, "events": events, "replays": replays}
    with _children(workdir, log) as kids:
        pubs = _Child("publishers", base, workdir, log)
        kids.append(pubs)
        eng = _Child("engines", base, workdir, log)
        kids.append(eng)
        eng.read("ready")
        ready = pubs.read("ready")
        out["publish_s"] = ready["seconds"]
        out["workload_s"] = time.perf_counter() - t0
        router_cfg = {**base, "router_port": free_port(), "last_seqs": last_seqs,
                      "decisions": decisions, "idle_s": idle_s,
                      "churn": churn_minutes > 0}  # fmt: skip
        router = _Child("router", router_cfg, workdir, log)
        kids.append(router)
        ing = router.read("ingested")
        out["entries"] = ing["entries"]
        out["ingest_memory_s"] = ing["seconds"]
        out["cold_catch_up_s"] = ing["cold_seconds"]
        out["ingest_cpu_s"] = ing["cpu_seconds"]
        out["ingest_memory_per_cpu_s"] = want_blocks / ing["cpu_seconds"]
        out["load_during_ingest"] = ing["load"]
        out["ingest_memory_per_s"] = want_blocks / ing["seconds"]
        out["rss_start_mb"] = ing["rss_start_kb"] / 1024
        out["rss_after_ingest_mb"] = ing["rss_kb"] / 1024
        out["bytes_per_entry"] = (
            (ing["rss_kb"] - ing["rss_start_kb"]) * 1024 / max(1, ing["entries"])
        )
        idle = router.read("idle")
        out["idle_probe_cpu_share"] = idle["cpu_share"]
        out["healthy"] = idle["healthy"]
        dec = router.read("decisions")
        out["decision"] = {k: v for k, v in dec.items() if k != "step"}
        router.read("serving")
        out["proxy"] = _proxy_latency(
            router_cfg["router_port"], ports, shape, proxy_requests, router.proc.pid
        )
        if redis:  # before churn, which rolls the backlog out of the publishers' buffers
            out.update(_redis_ingest(shape, base, last_seqs, redis_instances, workdir, log))
        if churn_minutes > 0:
            out["churn"] = _churn(pubs, router, churn_minutes, churn_rate, out["entries"])
        router.send("stop")
        done = router.read("done")
        out["peak_rss_mb"] = done["hwm_kb"] / 1024
        out["peak_bytes_per_entry"] = done["hwm_kb"] * 1024 / max(1, out["entries"])
    return out


def _churn(pubs: _Child, router: _Child, minutes: int, rate: float, entries: int) -> dict:
    """Simulated minutes of store/evict churn, each published as fast as it goes; the
    router's RSS once it has applied each minute, and the entries once churn is taken
    back (the index must hold what it held before)."""
    rss: list[float] = []
    blocks = 0
    wall = cpu = 0.0
    for _ in range(minutes):
        pubs.send(f"churn-minute {rate}")
        done = pubs.read("churn-minute")
        router.send("catch-up " + json.dumps(done["last_seqs"]))
        caught = router.read("caught-up")
        rss.append(caught["rss_kb"] / 1024)
        blocks += done["blocks"]
        wall, cpu = wall + caught["seconds"], cpu + caught["cpu_seconds"]
    pubs.send("churn-end")
    done = pubs.read("churn-end")
    router.send("catch-up " + json.dumps(done["last_seqs"]))
    caught = router.read("caught-up")
    half = max(1, len(rss) // 2)
    n = len(rss)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(rss)
    var = sum((x - mean_x) ** 2 for x in range(n)) or 1.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(rss)) / var
    return {
        "simulated_minutes": minutes,
        "rate_per_instance_s": rate,
        "block_events": blocks + done["blocks"],
        "rss_mb_per_minute": rss,
        "rss_first_mb": rss[0],
        "rss_last_mb": rss[-1],
        "rss_max_mb": max(rss),
        "rss_slope_mb_per_hour": slope * 60,
        "rss_growth_second_half_mb": max(rss[half:]) - max(rss[:half]) if n > 1 else 0.0,
        "router_wait_s": wall,  # the router catching up after each minute was published
        "router_cpu_s": cpu,
        "entries_before": entries,
        "entries_after": caught["entries"],
    }


def _redis_ingest(
    shape: FleetShape, base: dict[str, Any], last_seqs: list[int], k: int, workdir: Path,
    log: IO[str],
) -> dict[str, Any]:  # fmt: skip
    """A second cold router on a Redis index, following the first ``k`` instances."""
    from stack.procs import free_port, private_redis

    k = min(k, shape.instances)
    blocks = entries = 0
    for i in range(k):
        _, e, b = instance_batches(shape, i)
        entries, blocks = entries + e, blocks + b
    sub = {key: base[key][:k] for key in ("ports", "events", "replays")}
    with private_redis() as server:
        cfg = {**base, **sub, "router_port": free_port(), "last_seqs": last_seqs[:k],
               "index": server.url, "ingest_only": True}  # fmt: skip
        router = _Child("router", cfg, workdir, log)
        try:
            ing = router.read("ingested")
        finally:
            router.close()
    if ing["entries"] != entries:
        raise AssertionError(f"Redis index holds {ing['entries']} entries, expected {entries}")
    return {
        "redis_instances": k,
        "redis_entries": ing["entries"],
        "ingest_redis_s": ing["seconds"],
        "redis_cold_catch_up_s": ing["cold_seconds"],
        "ingest_redis_per_s": blocks / ing["seconds"],
        "ingest_redis_per_cpu_s": blocks / ing["cpu_seconds"],
    }


def _checks(row: dict[str, Any]) -> dict[str, bool]:
    n = row["instances"]
    dec = row["decision"]
    target = TARGETS["decision_p50_ms"].get(n)
    rss_target = TARGETS["peak_rss_mb_at_5m"] * max(1.0, row["entries"] / 5e6)
    out = {
        "entries_exact": row["entries"] == row["entries_expected"],
        "every_decision_correct": dec["correct"] == dec["checked"] > 0,
        "all_healthy": row["healthy"] == n,
        "decision_p50": target is None or dec["p50_ms"] <= target,
        "added_p50": row["proxy"]["added_p50_ms"] <= TARGETS["added_p50_ms"],
        "ingest_memory": row["ingest_memory_per_s"] >= TARGETS["ingest_memory_per_s"],
        "idle_probe_cpu": row["idle_probe_cpu_share"] < TARGETS["idle_probe_cpu_share"],
        "peak_rss": row["peak_rss_mb"] <= rss_target,
    }
    if "ingest_redis_per_s" in row:
        out["ingest_redis"] = row["ingest_redis_per_s"] >= TARGETS["ingest_redis_per_s"]
    if "churn" in row:
        c = row["churn"]
        # Flat: the trend over the run (samples after each minute's burst vary by
        # what the allocator has not handed back yet, either way).
        out["churn_flat"] = c["rss_slope_mb_per_hour"] <= 32
        out["churn_entries_back"] = c["entries_after"] == c["entries_before"]
    return out


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvroute bench fleet (one run per row)")
    cols = ("instances", "entries", "decision p50/p99 ms (CPU p50)", "added p50 ms",
            "peak RSS MB", "B/entry (growth, peak)", "ingest mem /s (/CPU-s)", "ingest Redis /s",
            "idle probe CPU", "correct")  # fmt: skip
    for c in cols:
        t.add_column(c)
    for row in report["fleets"]:
        dec = row["decision"]
        t.add_row(
            str(row["instances"]),
            f"{row['entries']:,}",
            f"{dec['p50_ms']:.1f} / {dec['p99_ms']:.1f} ({dec['cpu_p50_ms']:.1f})",
            f"{row['proxy']['added_p50_ms']:.1f}",
            f"{row['peak_rss_mb']:.0f}",
            f"{row['bytes_per_entry']:.0f}, {row['peak_bytes_per_entry']:.0f}",
            f"{row['ingest_memory_per_s']:,.0f} ({row['ingest_memory_per_cpu_s']:,.0f})",
            f"{row['ingest_redis_per_s']:,.0f}" if "ingest_redis_per_s" in row else "-",
            f"{100 * row['idle_probe_cpu_share']:.1f}%",
            f"{dec['correct']}/{dec['checked']}",
        )
    Console(width=200).print(t)
    for row in report["fleets"]:
        if "churn" in row:
            c = row["churn"]
            Console().print(
                f"churn {row['instances']} instances, {c['simulated_minutes']} simulated minutes "
                f"({c['block_events']:,} block events): RSS {c['rss_first_mb']:.0f} -> "
                f"{c['rss_last_mb']:.0f} MB (max {c['rss_max_mb']:.0f}, slope "
                f"{c['rss_slope_mb_per_hour']:+.1f} MB/h)"
            )
        failed = [k for k, ok in row["checks"].items() if not ok]
        Console().print(f"{row['instances']} instances: " + ("all targets met" if not failed
                        else "missed: " + ", ".join(failed)))  # fmt: skip


def run(
    out: Path,
    *,
    instances: tuple[int, ...] = (96, 256),
    entries: int = 5_000_000,
    prompt_tokens: int = 240_000,
    decisions: int = 60,
    proxy_requests: int = 40,
    idle_s: float = 10.0,
    redis: bool = True,
    redis_instances: int = 16,
    churn_minutes: int = 0,
    churn_rate: float = 1000.0,
    seed: int = 0,
    **shape_overrides: Any,
) -> dict[str, Any]:
    """Run every fleet size, print the table, write ``out/fleet.json``; return the report."""
    from bench.index import _machine

    logging.getLogger("httpx").setLevel(logging.WARNING)
    report: dict[str, Any] = {"targets": TARGETS, "fleets": []}
    out.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-fleet-") as tmp,
        open(out / "fleet.log", "w") as log,
    ):
        for n in instances:
            shape = FleetShape(instances=n, entries=entries, prompt_tokens=prompt_tokens,
                               seed=seed, **shape_overrides)  # fmt: skip
            row = _fleet(
                shape, decisions=decisions, proxy_requests=proxy_requests, idle_s=idle_s,
                redis=redis, redis_instances=redis_instances, churn_minutes=churn_minutes,
                churn_rate=churn_rate,
                workdir=Path(tmp), log=log,
            )  # fmt: skip
            row["shape"] = shape.to_dict()
            row["checks"] = _checks(row)
            report["fleets"].append(row)
            (out / "fleet.json").write_text(json.dumps(report, indent=2))  # row by row
    report["machine"] = _machine()
    _print(report)
    (out / "fleet.json").write_text(json.dumps(report, indent=2))
    return report
