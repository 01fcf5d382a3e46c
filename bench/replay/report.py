"""``report.md`` + ``results.json`` + PNG plots for a replay run.

Everything is derived from per-request records (``records.summarize``), so the markdown
table, the JSON and the plots always agree. Plots use matplotlib's Agg backend (files only,
no display).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import machine_info
from bench.replay.records import RequestRecord, load_series, summarize

__all__ = ["RunSet", "agreement", "targets", "write_report"]

log = logging.getLogger(__name__)

# mode -> router -> (records, instances)
RunSet = Mapping[str, Mapping[str, tuple[Sequence[RequestRecord], Sequence[str]]]]
AGREE_KEYS = ("hit_ratio", "gpu_hit_ratio", "cpu_hit_ratio", "ttft_p50_ms", "ttft_p90_ms")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def summary_table(summaries: Mapping[str, dict[str, Any]], oracle: float | None) -> str:
    """Markdown: one row per router, hit ratios relative to vllm-router when present."""
    base = summaries.get("vllm-router", {}).get("hit_ratio")
    rows = [
        "| router | ok/sent | hit (GPU+CPU) | GPU | CPU | x vllm-router | TTFT p50 ms "
        "| p90 | p99 | e2e p50 ms | p99 | req/s | pred. exact | max/mean load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summaries.items():
        rel = s["hit_ratio"] / base if base else None
        rows.append(
            f"| {name} | {s['ok']}/{s['requests']} | {_pct(s['hit_ratio'])} "
            f"| {_pct(s['gpu_hit_ratio'])} | {_pct(s['cpu_hit_ratio'])} | {_fmt(rel, 2)} "
            f"| {_fmt(s['ttft_p50_ms'], 0)} | {_fmt(s['ttft_p90_ms'], 0)} "
            f"| {_fmt(s['ttft_p99_ms'], 0)} | {_fmt(s['e2e_p50_ms'], 0)} "
            f"| {_fmt(s['e2e_p99_ms'], 0)} | {_fmt(s['throughput_req_s'], 2)} "
            f"| {_pct(s['prediction_exact'])} | {_fmt(s['imbalance_max_over_mean'], 2)} |"
        )
    if oracle is not None:
        rows.append(
            f"| *oracle (infinite cache, perfect routing)* | | {_pct(oracle)} "
            "| | | | | | | | | | | |"
        )
    return "\n".join(rows)


def targets(summaries: Mapping[str, dict[str, Any]], profile: str) -> list[dict[str, Any]]:
    """The issue's targets, evaluated (reported, never asserted)."""
    ours = summaries.get("ours:cost")
    peers = {k: v for k, v in summaries.items() if k in ("vllm-router", "sglang-router")}
    if ours is None or not peers:
        return []
    best_p90 = min(
        (v["ttft_p90_ms"] for v in peers.values() if v["ttft_p90_ms"] is not None), default=None
    )
    out = []
    vllm = peers.get("vllm-router")
    if profile != "full" and vllm and vllm["hit_ratio"]:
        ratio = ours["hit_ratio"] / vllm["hit_ratio"]
        out.append({"target": "reused prompt tokens >= 1.3x vllm-router", "value": ratio,
                    "met": ratio >= 1.3})  # fmt: skip
    if best_p90 and ours["ttft_p90_ms"] is not None:
        ratio = ours["ttft_p90_ms"] / best_p90
        if profile == "full":
            best_hit = max(v["hit_ratio"] for v in peers.values())
            out.append({"target": "TTFT p90 <= best peer", "value": ratio, "met": ratio <= 1.0})
            out.append({"target": "hit ratio >= best peer", "value": ours["hit_ratio"] -
                        best_hit, "met": ours["hit_ratio"] >= best_hit})  # fmt: skip
        else:
            out.append({"target": "TTFT p90 <= 0.6x best peer", "value": ratio,
                        "met": ratio <= 0.6})  # fmt: skip
    return out


def agreement(sim: Mapping[str, dict], live: Mapping[str, dict]) -> dict[str, dict[str, Any]]:
    """Sim vs live on the same subset, per router both modes ran: relative differences."""
    out: dict[str, dict[str, Any]] = {}
    for name in sim.keys() & live.keys():
        row: dict[str, Any] = {}
        for k in AGREE_KEYS:
            a, b = sim[name].get(k), live[name].get(k)
            rel = (a - b) / b if a is not None and b else None
            row[k] = {"sim": a, "live": b, "rel_diff": rel}
        out[name] = row
    return out


def _agreement_table(agree: Mapping[str, dict[str, Any]]) -> str:
    rows = ["| router | metric | sim | live | (sim-live)/live |", "|---|---|---|---|---|"]
    for name in sorted(agree):
        for k, v in agree[name].items():
            ratio = k.endswith("ratio")
            fa = _pct(v["sim"]) if ratio else _fmt(v["sim"], 0)
            fb = _pct(v["live"]) if ratio else _fmt(v["live"], 0)
            rows.append(f"| {name} | {k} | {fa} | {fb} | {_pct(v['rel_diff'])} |")
    return "\n".join(rows)


def plot_all(runs: RunSet, oracle: float | None, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    modes = list(runs)
    # TTFT CDF: one panel per mode, one line per router.
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for name, (recs, _) in runs[mode].items():
            xs = sorted(r.ttft_s * 1e3 for r in recs if r.ok and r.ttft_s is not None)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, replay clock)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"TTFT CDF ({mode})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Hit-token ratio: GPU and CPU stacked per router and mode, oracle as a line.
    labels, gpu, cpu = [], [], []
    for mode in modes:
        for name, (recs, inst) in runs[mode].items():
            s = summarize(recs, inst)
            labels.append(f"{name}\n({mode})" if len(modes) > 1 else name)
            gpu.append(100 * s["gpu_hit_ratio"])
            cpu.append(100 * s["cpu_hit_ratio"])
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    ax.bar(labels, gpu, label="GPU hit")
    ax.bar(labels, cpu, bottom=gpu, label="CPU hit")
    top = max([g + c for g, c in zip(gpu, cpu, strict=True)] + [0.0])
    if oracle is not None:
        ax.axhline(100 * oracle, color="k", linestyle="--", label="oracle")
        top = max(top, 100 * oracle)
    ax.set_ylim(0, top * 1.15 + 1)
    ax.set_ylabel("reused prompt tokens (%)")
    ax.set_title("Prompt tokens reused (engine-reported)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "hit_ratio.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Load per instance over time: one panel per (mode, router).
    panels = [(m, n) for m in modes for n in runs[m]]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8, 2.2 * len(panels)), squeeze=False, sharex=False
    )
    for ax, (mode, name) in zip(axes[:, 0], panels, strict=True):
        recs, inst = runs[mode][name]
        times, series = load_series(recs, inst)
        for iname, ys in sorted(series.items()):
            if times:
                ax.plot(times, ys, linewidth=0.8, label=iname)
        ax.set_title(f"{name} ({mode}): requests in flight per instance", fontsize=9)
        ax.set_ylabel("in flight")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("replay time (s)")
    if panels:
        axes[0, 0].legend(fontsize=6, ncol=4)
    fig.tight_layout()
    paths.append(out / "load_over_time.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def write_report(
    out: Path,
    runs: RunSet,
    *,
    command: str,
    config: dict[str, Any],
    trace_info: dict[str, Any],
    notes: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write report.md, results.json and the plots under ``out``; returns the results."""
    out.mkdir(parents=True, exist_ok=True)
    summaries = {m: {n: summarize(r, i) for n, (r, i) in rs.items()} for m, rs in runs.items()}
    oracle = trace_info.get("oracle_hit_ratio")
    profile = config.get("engine", {}).get("profile", "")
    tgt = {m: targets(s, profile) for m, s in summaries.items()}
    agree = agreement(summaries["sim"], summaries["live"]) if len(summaries) == 2 else {}
    machine = machine_info()
    results = {
        "command": command,
        "machine": machine,
        "config": config,
        "trace": trace_info,
        "summaries": summaries,
        "targets": tgt,
        "agreement": agree,
        **(extra or {}),
        "records": {
            m: {n: [r.to_dict() for r in recs] for n, (recs, _) in rs.items()}
            for m, rs in runs.items()
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plots = plot_all(runs, oracle, out)
    e = config.get("engine", {})
    lines = [
        f"# kvroute bench replay: {trace_info.get('name', '')}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine['processor']}, {machine['cpus']} CPUs, {machine['platform']}, "
        f"Python {machine['python']}, load average {machine['loadavg']}, {machine['time']}.",
        "",
        f"Setup: {config.get('engines')} engines, profile `{e.get('profile')}`, "
        f"{e.get('gpu_blocks')} GPU blocks + {e.get('cpu_blocks')} CPU blocks of "
        f"{e.get('block_size')} tokens per engine (window {e.get('sliding_window')}), "
        f"prefill {e.get('prefill_tokens_per_s')} tok/s, time scale {config.get('time_scale')}, "
        f"output capped at {config.get('max_output_tokens')} tokens, seed {config.get('seed')}. "
        f"Requests: {trace_info.get('requests')} ({trace_info.get('prompt_tokens'):,} prompt "
        f"tokens). Oracle hit ratio (infinite cache, perfect routing): {_pct(oracle)}.",
        "",
        "Times are on the replay clock: at time scale S the engines run S times faster than "
        "the timing model's real time, so multiply by S for model-time figures.",
    ]
    for mode, s in summaries.items():
        lines += ["", f"## {mode}", "", summary_table(s, oracle)]
        if tgt[mode]:
            lines += ["", "Targets (reported, not tuned for):", ""]
            for t in tgt[mode]:
                lines.append(
                    f"- {t['target']}: {_fmt(t['value'], 2)} -> {'met' if t['met'] else 'MISSED'}"
                )
    if agree:
        lines += ["", "## sim vs live (same requests)", "", _agreement_table(agree)]
    if notes:
        lines += ["", "## notes", ""] + [f"- {n}" for n in notes]
    lines += ["", "## plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return results
