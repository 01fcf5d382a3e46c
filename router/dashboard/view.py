"""The page's view model and its server-side rendering.

A snapshot (``router.dashboard.snapshot``) becomes cards and tables of display cells
(formatted here, once); the server renders them into the first paint, and the page's
script re-renders the same model from ``/dashboard/state`` with the same rules (see
``dashboard.js``: ``cell``/``table``/``cards`` mirror ``_cell``/``render_table``/
``render_cards``).

A cell is a string or ``{"t": text, "c": css class, "h": href, "title": tooltip,
"m": 0..1 for a meter}``; a table is ``{"cols": [...], "rows": [{"k": key, "cells":
[...]}], "empty": text, "left": [indices of left-aligned text columns]}`` (the first
column is always left-aligned).
"""

from __future__ import annotations

import time
from html import escape
from typing import Any
from urllib.parse import urlparse

__all__ = ["SECTIONS", "build_view", "render_cards", "render_table"]

Cell = str | dict[str, Any]
NA = "\u2013"  # an en dash: no value
DECISION_ROWS = 25  # the page shows these; /dashboard/state has every kept one

# (container id, title, note) in page order; the ids are the view's table keys.
SECTIONS = (
    ("instances", "Instances", "health, load (router-side and engine-reported), KV usage, hits"),
    ("residency", "Index residency", "distinct blocks per KV cache group and tier"),
    ("ingest", "Ingest", "KV event streams per instance"),
    ("decisions", "Recent decisions", "newest first; explain = the /debug/route view"),
)


def _n(v: float | None) -> str:
    if v is None:
        return NA
    v = float(v)
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div * 10:
            return f"{v / div:.1f}{suffix}" if abs(v) < div * 100 else f"{v / div:.0f}{suffix}"
    return f"{v:.0f}" if v == int(v) else f"{v:.1f}"


def _pct(v: float | None) -> str:
    return NA if v is None else f"{v * 100:.1f}%"


def _ms(v: float | None) -> str:
    if v is None:
        return NA
    return f"{v:.2f} ms" if v < 1 else f"{v:.1f} ms" if v < 100 else f"{v:.0f} ms"


def _age(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f} s ago"
    if s < 3600:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def _host(url: str) -> str:
    p = urlparse(url)
    return p.netloc or url


def _inst(url: str) -> Cell:
    return {"t": _host(url), "title": url, "c": "inst"}


def _meter(v: float | None) -> Cell:
    if v is None:
        return {"t": NA, "c": "na"}
    return {"t": _pct(v), "m": max(0.0, min(1.0, v))}


def _cards(snap: dict[str, Any]) -> list[dict[str, Any]]:
    r, t = snap["router"], snap["totals"]
    req = t["requests"]
    ok = req.get("ok", 0)
    errors = sum(v for k, v in req.items() if k != "ok")
    pred = t["predictions"]
    judged = sum(pred.values())
    hit = t["hit_ratio"]
    p, q = t["predicted_tokens"], t["reported_tokens"]
    return [
        {
            "k": "instances",
            "label": "instances up",
            "v": f"{r['healthy']}/{r['instances']}",
            "c": "ok" if r["healthy"] == r["instances"] and r["instances"] else "bad",
            "sub": f"policy {r['policy']} · index {r['index']}",
        },
        {
            "k": "requests",
            "label": "requests served",
            "v": _n(ok),
            "sub": f"{_n(errors)} failed · {_n(sum(t['retries'].values()))} retried",
            "c": "bad" if errors else "",
        },
        {
            "k": "hit",
            "label": "hit ratio GPU · CPU",
            "v": f"{_pct(hit['gpu'])} · {_pct(hit['cpu'])}",
            "sub": f"engines: of {_n(t['engine_prefix_queries'])} prompt tokens",
        },
        {
            "k": "exact",
            "label": "exact hit predictions",
            "v": _pct(pred["exact"] / judged) if judged else NA,
            "sub": f"exact {_n(pred['exact'])} · over {_n(pred['over'])} · "
            f"under {_n(pred['under'])}",
            "c": "ok" if judged and pred["exact"] == judged else "warn" if judged else "",
        },
        {
            "k": "tokens",
            "label": "hit tokens predicted / reported",
            "v": f"{_n(p['gpu'] + p['cpu'])} / {_n(q['gpu'] + q['cpu'])}",
            "sub": f"GPU {_n(p['gpu'])}/{_n(q['gpu'])} · CPU {_n(p['cpu'])}/{_n(q['cpu'])}",
        },
        {
            "k": "decision",
            "label": "decision time (mean)",
            "v": _ms(t["decision_mean_ms"]),
            "sub": f"{_n(t['decisions'])} decisions · {_n(t['index_errors'])} index errors",
            "c": "bad" if t["index_errors"] else "",
        },
    ]


def _instances(snap: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for i in snap["instances"]:
        e = i["engine"]
        if i["healthy"]:
            health: Cell = {"t": "up", "c": "ok"}
        else:
            down = i["down_for_s"]
            health = {"t": "down" + (f" {down:.0f} s" if down is not None else ""), "c": "bad"}
        rows.append(
            {
                "k": i["url"],
                "cells": [
                    _inst(i["url"]),
                    health,
                    _n(i["served"]),
                    f"{i['inflight_requests']} / {_n(i['inflight_prefill_tokens'])}",
                    str(i["running_requests"]),
                    _n(e.get("running")),
                    str(i["engine_waiting"]),
                    _meter(e.get("kv_gpu_usage")),
                    _meter(e.get("kv_cpu_usage")),
                    _pct(i["hit_ratio"]["gpu"]),
                    _pct(i["hit_ratio"]["cpu"]),
                    _ms(i["ttft_mean_ms"]),
                    {"t": _n(i["errors"]), "c": "bad" if i["errors"] else ""},
                ],
            }
        )
    return {
        "cols": [
            "instance",
            "health",
            "served",
            "in flight req / tok",
            "streaming",
            "eng. running",
            "eng. waiting",
            "KV GPU",
            "KV CPU",
            "hit GPU",
            "hit CPU",
            "TTFT mean",
            "errors",
        ],
        "rows": rows,
        "empty": "no instances registered",
    }


def _residency(snap: dict[str, Any]) -> dict[str, Any]:
    groups: dict[int, str] = {}
    for i in snap["instances"]:
        for g, spec in enumerate(i["layout"]["groups"]):
            groups.setdefault(g, spec["label"])
        for b in i["blocks"] or ():
            groups.setdefault(int(b["group"]), "?")
    slots = [(g, tier) for g in sorted(groups) for tier in ("gpu", "cpu")]
    rows = []
    for i in snap["instances"]:
        held = {(int(b["group"]), b["tier"]): b["blocks"] for b in i["blocks"] or ()}
        layout = " + ".join(g["label"] for g in i["layout"]["groups"]) or NA
        cells: list[Cell] = [_inst(i["url"]), {"t": layout, "title": i["layout"]["source"]}]
        if i["blocks"] is None:
            cells += [{"t": NA, "c": "na"} for _ in slots] + [NA]
        else:
            cells += [_n(held.get(s, 0)) for s in slots] + [_n(sum(held.values()))]
        rows.append({"k": i["url"], "cells": cells})
    cols = ["instance", "layout"]
    cols += [f"g{g} {groups[g]} · {tier.upper()}" for g, tier in slots] + ["total"]
    note = "" if snap["router"]["index_counts"] else " (this index backend does not count blocks)"
    return {"cols": cols, "rows": rows, "empty": "no instances registered" + note, "left": [1]}


def _view(view: dict[str, Any] | None) -> Cell:
    """Complete or partial (vLLM's replay buffer no longer reaches seq 0), and why."""
    if view is None:
        return NA
    lost = view["lost_seqs"]
    if view["view"] == "partial":
        why = f"batches {lost[0]}..{lost[1]} gone" if lost else "cleared, no replay"
        return {"t": "partial", "c": "bad", "title": f"{why} (since {view['origin']})"}
    if view["view"] == "complete":
        return {"t": "complete", "title": f"from {view['origin']}"}
    return {"t": "waiting", "c": "na", "title": "no batch applied since the rebuild began"}


def _ingest(snap: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for i in snap["instances"]:
        g = i["ingest"]
        if g is None:
            cells: list[Cell] = [_inst(i["url"]), {"t": "no event stream", "c": "na"}]
            cells += ["" for _ in range(9)]
            rows.append({"k": i["url"], "cells": cells})
            continue
        ev = g["events_applied"]
        rows.append(
            {
                "k": i["url"],
                "cells": [
                    _inst(i["url"]),
                    _view(g["view"]),
                    NA if g["last_seq"] is None else str(g["last_seq"]),
                    f"{_n(g['batches_live'])} / {_n(g['batches_replay'])}",
                    f"{_n(ev.get('BlockStored', 0))} / {_n(ev.get('BlockRemoved', 0))}"
                    f" / {_n(ev.get('AllBlocksCleared', 0))}",
                    _ms(g["lag_ms"]),
                    {"t": str(g["gaps"]), "c": "bad" if g["gaps"] else ""},
                    {"t": str(g["missed_batches"]), "c": "bad" if g["missed_batches"] else ""},
                    f"{g['resyncs']} / {g['restarts']}",
                    {
                        "t": f"{g['undecodable']} / {g['errors']}",
                        "c": "bad" if g["undecodable"] or g["errors"] else "",
                    },
                ],
            }
        )
    return {
        "cols": [
            "instance",
            "view",
            "last seq",
            "batches live / replay",
            "events stored / removed / cleared",
            "lag (last live batch)",
            "gaps",
            "missed batches",
            "resyncs / restarts",
            "undecodable / errors",
        ],
        "rows": rows,
        "empty": "no instances registered",
    }


def _decisions(snap: dict[str, Any]) -> dict[str, Any]:
    now = snap["generated_at"]
    rows = []
    for d in snap["decisions"][:DECISION_ROWS]:
        ru = d["runner_up"]
        if d["predicted_ttft_ms"] is None:
            ttft: Cell = NA
        else:
            ttft = {
                "t": _ms(d["predicted_ttft_ms"]),
                "title": f"queue {_ms(d['queue_ms'])} + prefill {_ms(d['prefill_ms'])} + "
                f"load {_ms(d['load_ms'])}",
            }
        if ru is None:
            runner: Cell = NA
        else:
            runner = {
                "t": f"{_host(ru['instance'])}: {_n(ru['gpu_tokens'] + ru['cpu_tokens'])} tok, "
                f"{_ms(ru['predicted_ttft_ms'])}",
                "title": ru["instance"],
            }
        rows.append(
            {
                "k": str(d["id"]),
                "cells": [
                    {"t": f"#{d['id']}", "title": time.strftime("%X", time.localtime(d["ts"]))},
                    {"t": _age(now - d["ts"]), "c": "age"},
                    _inst(d["instance"]),
                    _n(d["prompt_tokens"]),
                    f"{_n(d['gpu_tokens'])} / {_n(d['cpu_tokens'])}",
                    ttft,
                    runner,
                    {"t": d["reason"], "c": "reason"},
                    {"t": "explain", "h": f"dashboard/decisions/{d['id']}"},
                ],
            }
        )
    return {
        "cols": [
            "#",
            "when",
            "chosen",
            "prompt tok",
            "hit GPU / CPU",
            "pred. TTFT",
            "runner-up",
            "reason",
            "",
        ],
        "rows": rows,
        "empty": "no requests routed yet",
        "left": [2, 6, 7],
    }


def build_view(snap: dict[str, Any]) -> dict[str, Any]:
    r = snap["router"]
    return {
        "title": f"policy {r['policy']} · index {r['index']} · "
        f"{r['healthy']}/{r['instances']} instances up",
        "cards": _cards(snap),
        "tables": {
            "instances": _instances(snap),
            "residency": _residency(snap),
            "ingest": _ingest(snap),
            "decisions": _decisions(snap),
        },
    }


# ---- server-side rendering (the page's first paint) ----------------------------------


def _cell(c: Cell, left: bool) -> str:
    if isinstance(c, str):
        c = {"t": c}
    classes = " ".join(x for x in (c.get("c"), "l" if left else "") if x)
    attrs = f' class="{escape(classes)}"' if classes else ""
    if c.get("title"):
        attrs += f' title="{escape(c["title"])}"'
    text = escape(str(c.get("t", "")))
    if c.get("h"):
        inner = f'<a href="{escape(c["h"])}" target="_blank" rel="noopener">{text}</a>'
    elif c.get("m") is not None:
        inner = f'<meter min="0" max="1" value="{float(c["m"]):.4f}"></meter> {text}'
    else:
        inner = text
    return f"<td{attrs}>{inner}</td>"


def render_table(spec: dict[str, Any]) -> str:
    left = set(spec.get("left", ()))
    head = "".join(
        f'<th class="l">{escape(c)}</th>' if i in left else f"<th>{escape(c)}</th>"
        for i, c in enumerate(spec["cols"])
    )
    if spec["rows"]:
        body = "".join(
            f'<tr data-k="{escape(r["k"])}">'
            + "".join(_cell(c, i in left) for i, c in enumerate(r["cells"]))
            + "</tr>"
            for r in spec["rows"]
        )
    else:
        span = len(spec["cols"])
        body = f'<tr><td class="empty" colspan="{span}">{escape(spec["empty"])}</td></tr>'
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_cards(cards: list[dict[str, Any]]) -> str:
    return "".join(
        f'<div class="card {escape(c.get("c") or "")}" id="card-{escape(c["k"])}">'
        f'<div class="l">{escape(c["label"])}</div><div class="v">{escape(c["v"])}</div>'
        f'<div class="s">{escape(c["sub"])}</div></div>'
        for c in cards
    )
