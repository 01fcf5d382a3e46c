"""The suite's ``report.md`` tables and plots (bar charts with 95% intervals)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_suite", "suite_markdown"]


def _cell(a: dict[str, Any], k: str, pct: bool = False, digits: int = 0) -> str:
    cell = a.get(k) or {}  # results written before a metric existed lack it
    m, ci = cell.get("mean"), cell.get("ci95")
    if m is None:
        return "-"
    f = 100.0 if pct else 1.0
    s = f"{m * f:.{1 if pct else digits}f}"
    if ci is not None:
        s += f" ± {ci * f:.{1 if pct else digits}f}"
    return s + ("%" if pct else "")


def suite_markdown(res: dict[str, Any], plots: list[Path]) -> str:
    lines = [
        "# Routing-quality suite",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Seeds: sim {res['seeds']}, live {res['live_seeds']}. Cells: mean ± 95% interval "
        "(Student t over seeds). Times are replay-clock ms at each workload's time scale. "
        "`model:*` rows are in-process models of the peer routers "
        "(`bench/replay/peer_models.py`); live rows are the real routers. Predicted hit "
        "lost: prompt tokens the router predicted cached at the instance it chose that the "
        "engine no longer held when it admitted the request (evicted while it queued), by "
        "that router's own scorer (the vLLM-router model's is full-attention-only; the "
        "sglang-router model predicts none).",
        "",
    ]
    for k, w in res["workloads"].items():
        lines.append(f"- **{k}**: {w['description']}; {w['engines']} engines, "
                     f"{w['engine']['profile']}, {w['engine']['gpu_blocks']} GPU blocks, "
                     f"time scale {w['time_scale']:g}")  # fmt: skip
    for mode, ws in res["aggregate"].items():
        if not ws:
            continue
        lines += ["", f"## {mode}", ""]
        for k, per in ws.items():
            lines += [
                f"### {k}",
                "",
                "| router | reused tokens | TTFT p50 ms | p90 | p99 | req/s | errors "
                "| predicted hit lost |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for r, a in per.items():
                lines.append(
                    f"| {r} | {_cell(a, 'hit_ratio', pct=True)} | {_cell(a, 'ttft_p50_ms')} "
                    f"| {_cell(a, 'ttft_p90_ms')} | {_cell(a, 'ttft_p99_ms')} "
                    f"| {_cell(a, 'throughput_req_s', digits=2)} | {a['errors']} "
                    f"| {_cell(a, 'predicted_hit_lost_ratio', pct=True)} |"
                )
            t = res["targets"][mode].get(k)
            if t:
                lines += [
                    "",
                    f"Target vs best peer: reused x{t['hit_ratio_x']:.2f} ({t['best_peer_hit']}),"
                    f" TTFT p50 x{t['ttft_p50_x']:.2f} ({t['best_peer_p50']}),"
                    f" p90 x{t['ttft_p90_x']:.2f} ({t['best_peer_p90']}):"
                    f" {'met' if t['met'] else 'missed'}"
                    + (
                        f"; 1.3x / 0.7x target {'met' if t['met_1_3x'] else 'missed'}"
                        if "met_1_3x" in t
                        else ""
                    ),
                ]
            lines.append("")
    lines += _real_vllm(res.get("real_vllm"))
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def plot_suite(agg: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric, label, fname in (
        ("hit_ratio", "reused prompt tokens", "suite_hits.png"),
        ("ttft_p90_ms", "TTFT p90 (ms)", "suite_ttft.png"),
    ):
        panels = [(m, k) for m, ws in agg.items() for k in ws]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
        for ax, (mode, k) in zip(axes[0], panels, strict=True):
            per = agg[mode][k]
            names = list(per)
            f = 100.0 if metric == "hit_ratio" else 1.0
            ys = [(per[n][metric]["mean"] or 0) * f for n in names]
            es = [(per[n][metric]["ci95"] or 0) * f for n in names]
            ax.bar(range(len(names)), ys, yerr=es, capsize=3,
                   color=["C0" if n == "ours:cost" else "C7" for n in names])  # fmt: skip
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels([n.split(":")[-1] for n in names], rotation=60, fontsize=6)
            ax.set_title(f"{k} ({mode})", fontsize=7)
            ax.set_ylabel(label if ax is axes[0][0] else "", fontsize=7)
        fig.tight_layout()
        paths.append(out / fname)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def _real_vllm(real: dict[str, Any] | None) -> list[str]:
    """The real-vLLM section: reuse as vLLM counts it, TTFT as the client saw it."""
    if not real:
        return []
    lines = [
        "## real vLLM",
        "",
        f"`a_real_shape`'s workload on 3 real vLLM CPU engines per router (fresh each time), "
        f"seeds {real['seeds']}, the routers' order rotating per seed; ours tokenizes with "
        f"`{real.get('ours_tokenizer', 'remote')}`. Reused and uncached prompt tokens are "
        "vLLM's own counters (`vllm:prefix_cache_{hits,queries}_total`); TTFT in wall ms.",
        "",
        "| router | reused tokens | uncached tokens | TTFT p50 ms | p90 |",
        "|---|---|---|---|---|",
    ]
    for r, a in real.items():
        if isinstance(a, dict) and "cells" in a:
            lines.append(
                f"| {r} | {_cell(a, 'reused_ratio', pct=True)} | {_cell(a, 'uncached_tokens')} "
                f"| {_cell(a, 'ttft_p50_ms')} | {_cell(a, 'ttft_p90_ms')} |"
            )
    return [*lines, ""]
