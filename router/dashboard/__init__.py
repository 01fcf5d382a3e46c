"""``GET /dashboard``: the operator's live view of one router, served by the router itself.

One self-contained page (inline CSS and script, no CDN, no web fonts), rendered by the
server on first paint and then refreshed by polling ``GET /dashboard/state`` (JSON: the raw
snapshot plus the view model the page draws). ``GET /dashboard/decisions/{id}`` explains a
recent decision the way ``POST /debug/route`` does: ranking and TTFT breakdown as decided,
per-group residency as the index holds it now. Read-only; ``dashboard: false``
(``KVROUTE_DASHBOARD=false``) leaves every route unregistered (404).

Cost on the request path: one deque append per forwarded request (the decision object is
kept, never the prompt). A snapshot is built at most every ``min_interval_s`` however many
pages poll.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import functools
import hashlib
import itertools
import time
from html import escape
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response

from router.dashboard.snapshot import Recorded, build_snapshot
from router.dashboard.view import SECTIONS, build_view, render_cards, render_table
from router.decision.explain import explain

if TYPE_CHECKING:
    from router.decision.decide import RouteDecision
    from router.state import RouterState

__all__ = ["Dashboard", "mount_dashboard"]

POLL_INTERVAL_S = 1.0


@functools.cache
def _assets() -> tuple[str, str, str]:
    """The page template with its CSS and script inlined, and the CSP allowing exactly
    those two inline blocks (by hash) and same-origin fetches."""
    pkg = resources.files(__package__)
    css = pkg.joinpath("dashboard.css").read_text(encoding="utf-8")
    js = pkg.joinpath("dashboard.js").read_text(encoding="utf-8")
    page = pkg.joinpath("page.html").read_text(encoding="utf-8")
    page = page.replace("/*@css*/", css).replace("//@js", js)

    def sha(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    csp = (
        f"default-src 'none'; script-src {sha(js)}; style-src {sha(css)}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return page, csp, f"{POLL_INTERVAL_S:g}"


class Dashboard:
    """Recent decisions (a bounded ring) and the cached snapshot of one router."""

    def __init__(self, state: RouterState, *, keep: int = 50, min_interval_s: float = 0.5):
        self.state = state
        self.started = time.time()
        self.min_interval_s = min_interval_s
        self._ring: collections.deque[Recorded] = collections.deque(maxlen=keep)
        self._ids = itertools.count(1)
        self._cached: tuple[float, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    @property
    def keep(self) -> int:
        return self._ring.maxlen or 0

    def record(self, decision: RouteDecision, kind: str) -> None:
        """A forwarded request's decision (the hot path: one append)."""
        self._ring.append(Recorded(next(self._ids), time.time(), kind, decision))

    def find(self, decision_id: int) -> Recorded | None:
        return next((r for r in self._ring if r.id == decision_id), None)

    async def snapshot(self) -> dict[str, Any]:
        """``{"state": raw snapshot, "view": the page's model}``, rebuilt at most every
        ``min_interval_s``; concurrent pollers share one build."""
        async with self._lock:
            now = time.monotonic()
            if self._cached is not None and now - self._cached[0] < self.min_interval_s:
                return self._cached[1]
            snap = await build_snapshot(self.state, list(self._ring), started=self.started)
            out = {**snap, "view": build_view(snap)}
            self._cached = (now, out)
            return out

    async def page(self) -> str:
        template, _, interval = _assets()
        view = (await self.snapshot())["view"]
        sections = "".join(
            f'  <section class="block"><h2>{escape(title)}<small>{escape(note)}</small></h2>'
            f'<div class="tw" id="t-{key}">{render_table(view["tables"][key])}</div></section>\n'
            for key, title, note in SECTIONS
        )
        return (
            template.replace("<!--@title-->", escape(view["title"]))
            .replace("<!--@cards-->", render_cards(view["cards"]))
            .replace("<!--@sections-->", sections)
            .replace("<!--@interval-->", interval)
        )


_HEADERS = {
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def mount_dashboard(app: FastAPI, state: RouterState) -> Dashboard:
    """Register ``/dashboard``, ``/dashboard/state`` and ``/dashboard/decisions/{id}``."""
    dash = Dashboard(state)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        _, csp, _ = _assets()
        headers = {**_HEADERS, "content-security-policy": csp, "x-frame-options": "DENY"}
        return HTMLResponse(await dash.page(), headers=headers)

    @app.get("/dashboard/state", include_in_schema=False)
    async def dashboard_state() -> Response:
        return JSONResponse(await dash.snapshot(), headers=_HEADERS)

    @app.get("/dashboard/decisions/{decision_id}", include_in_schema=False)
    async def dashboard_decision(decision_id: int) -> Response:
        rec = dash.find(decision_id)
        if rec is None:
            body = {
                "error": {
                    "message": f"decision {decision_id} is no longer kept (the last "
                    f"{dash.keep} are)",
                    "type": "NotFound",
                    "param": None,
                    "code": 404,
                }
            }
            return JSONResponse(body, status_code=404, headers=_HEADERS)
        explained = await explain(state.router, rec.decision)
        return JSONResponse(
            {
                "id": rec.id,
                "recorded_at": rec.ts,
                "kind": rec.kind,
                "note": "ranking, hits and TTFT breakdown as decided; 'groups' is the "
                "residency the index holds now (POST /debug/route re-decides a body)",
                **explained,
            },
            headers=_HEADERS,
        )

    return dash
