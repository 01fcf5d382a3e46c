"""The router's HTTP surface: OpenAI proxy endpoints, debug, admin, health, metrics."""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.dashboard import mount_dashboard
from router.decision.explain import explain
from router.fleet.specs import parse_instance
from router.http.fastpath import ProxyEndpoints, parse_body, read_body
from router.http.gate import route_request
from router.http.replies import Reply, as_response, error_reply
from router.state import RouterState

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def error_response(message: str, status: int, err_type: str = "BadRequestError") -> Response:
    return as_response(error_reply(message, status, err_type))


def _authorized(request: Request, token: str) -> bool:
    got = request.headers.get("authorization", "")
    scheme, _, value = got.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        value.strip().encode(), token.encode()
    )


def create_app(state: RouterState) -> ProxyEndpoints:
    """The ASGI app: the proxy endpoints in front (``router.http.fastpath``), FastAPI behind
    (``.app``) for everything else."""
    app = FastAPI(title="kvroute router", docs_url=None, redoc_url=None)
    s = state.settings
    dashboard = mount_dashboard(app, state) if s.dashboard else None

    @app.post("/debug/route")
    async def debug_route(request: Request) -> Response:
        """The decision for an OpenAI body, without forwarding it."""
        raw = await read_body(request.scope, request.receive, s.max_body_bytes)
        if isinstance(raw, Reply):
            return as_response(raw)
        parsed = parse_body(raw, None)
        if isinstance(parsed, Reply):
            return as_response(parsed)
        kind, data = parsed
        routed = await route_request(state, data, kind, request.scope["headers"], forward=False)
        if isinstance(routed, Reply):
            return as_response(routed)
        out = await explain(state.router, routed.decision)
        out["model"] = {
            "requested": data.get("model"),
            "pool": [i.url for i in routed.pool],  # candidates: those of it not busy
            "lora": routed.lora[0] if routed.lora else None,
        }
        out["admission"] = state.admission.describe(routed.pool)
        return JSONResponse(out)

    @app.get("/v1/models")
    async def models() -> Response:
        """Every model and adapter the healthy instances serve, as of their last probe."""
        cards = state.models.cards(state.registry.healthy())
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/health")
    async def health() -> Response:
        up = len(state.registry.healthy())
        return JSONResponse(
            {"status": "ok" if up else "no healthy instance", "healthy_instances": up},
            status_code=200 if up else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        for inst in state.registry.all():
            state.metrics.healthy.labels(inst.url).set(1 if inst.healthy else 0)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- admin (bearer token; disabled without KVROUTE_ADMIN_TOKEN) -------------------

    def _admin_guard(request: Request) -> Response | None:
        if not s.admin_token:
            return error_response("admin API disabled (set KVROUTE_ADMIN_TOKEN)", 404, "NotFound")
        if not _authorized(request, s.admin_token):
            return error_response("invalid or missing bearer token", 401, "AuthenticationError")
        return None

    @app.get("/admin/instances")
    async def list_instances(request: Request) -> Response:
        if (err := _admin_guard(request)) is not None:
            return err
        return JSONResponse({"instances": [state.describe(i) for i in state.registry.all()]})

    @app.post("/admin/instances")
    async def add_instance(request: Request) -> Response:
        if (err := _admin_guard(request)) is not None:
            return err
        raw = await read_body(request.scope, request.receive, 64 * 1024)
        if isinstance(raw, Reply):
            return as_response(raw)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            return error_response(f"invalid JSON body: {exc}", 400)
        if not isinstance(data, dict):
            return error_response("request body must be a JSON object", 400)
        try:
            spec = parse_instance(str(data.get("instance", "")))
            inst = await state.add_instance(spec)
        except ValueError as exc:
            return error_response(str(exc), 400)
        return JSONResponse(state.describe(inst), status_code=201)

    @app.delete("/admin/instances")
    async def remove_instance(request: Request, url: str = "") -> Response:
        if (err := _admin_guard(request)) is not None:
            return err
        if not await state.remove_instance(url):
            return error_response(f"no instance {url!r}", 404, "NotFound")
        return JSONResponse({"removed": url.rstrip("/")})

    return ProxyEndpoints(app, state, dashboard)
