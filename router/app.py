"""The router's HTTP surface: OpenAI proxy endpoints, debug, admin, health, metrics."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.admission import Rejected, rejected_response
from router.config import parse_instance
from router.dashboard import mount_dashboard
from router.decide import RouteDecision
from router.models import unknown_model_response
from router.proxy import error_response, request_headers
from router.state import RouterState

__all__ = ["create_app"]

log = logging.getLogger(__name__)

_REQUIRED = {"completion": "prompt", "chat": "messages"}


async def _read_json(request: Request, limit: int) -> tuple[bytes, dict[str, Any]] | Response:
    """The raw body (forwarded as is) and its parsed object; 4xx before reading too much."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return error_response(f"request body over {limit} bytes", 413, "RequestTooLarge")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return error_response(f"request body over {limit} bytes", 413, "RequestTooLarge")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # also bad UTF-8, 4300+ digit ints, deep nesting
        return error_response(f"invalid JSON body: {exc}", 400)
    if not isinstance(data, dict):
        return error_response("request body must be a JSON object", 400)
    return bytes(body), data


def _validate(kind: str, data: dict[str, Any]) -> Response | None:
    field = _REQUIRED[kind]
    if field not in data:
        return error_response(f"missing required field '{field}'", 400)
    value = data[field]
    if kind == "chat" and (not isinstance(value, list) or not value):
        return error_response("'messages' must be a non-empty list", 400)
    if kind == "completion" and not isinstance(value, str | list):
        return error_response("'prompt' must be a string or a list of token ids", 400)
    if "stream" in data and not isinstance(data["stream"], bool):
        return error_response("'stream' must be a boolean", 400)
    return None


def _authorized(request: Request, token: str) -> bool:
    got = request.headers.get("authorization", "")
    scheme, _, value = got.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        value.strip().encode(), token.encode()
    )


def create_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="kvroute router", docs_url=None, redoc_url=None)
    s = state.settings
    dashboard = mount_dashboard(app, state) if s.dashboard else None

    async def _decide(
        request: Request, kind: str | None, *, forward: bool = True
    ) -> tuple[bytes, dict[str, Any], RouteDecision] | Response:
        """Read, validate and route an OpenAI body (``kind`` None: told by its fields)."""
        parsed = await _read_json(request, s.max_body_bytes)
        if isinstance(parsed, Response):
            return parsed
        raw, data = parsed
        if kind is None:
            kind = "chat" if "messages" in data else "completion"
        if (err := _validate(kind, data)) is not None:
            return err
        model = data.get("model")
        pool = state.models.pool(model, state.registry.healthy(), state.registry.all())
        if pool is None:
            return unknown_model_response(model)
        ticket = None
        if forward:
            ticket = await state.admission.admit(pool)
            if isinstance(ticket, Rejected):
                return rejected_response(ticket)
        pool = state.admission.open_instances(pool)
        lora = state.models.adapter(model, pool)
        session = state.affinity.session_key(request.headers, data)
        decision = None
        try:
            decision = await state.router.decide(
                data, kind, record=forward, instances=pool, lora=lora, session=session
            )
        finally:
            if decision is None and ticket is not None:
                ticket.release()  # not routed: none healthy, an error, the client gone
        if decision is None:
            return error_response("no healthy instance", 503, "ServiceUnavailableError")
        decision.ticket = ticket
        if forward and dashboard is not None:
            dashboard.record(decision, kind)
        return raw, data, decision

    async def _proxy(request: Request, kind: str, path: str) -> Response:
        routed = await _decide(request, kind)
        if isinstance(routed, Response):
            return routed
        raw, data, decision = routed
        streaming = bool(data.get("stream"))
        try:
            return await state.forwarder.forward(
                path, raw, request_headers(request.headers), decision, streaming
            )
        finally:
            if decision.ticket is not None:  # no forward started (all failed): free it
                decision.ticket.release()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(request, "completion", "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _proxy(request, "chat", "/v1/chat/completions")

    @app.post("/debug/route")
    async def debug_route(request: Request) -> Response:
        """The decision for an OpenAI body, without forwarding it."""
        routed = await _decide(request, None, forward=False)
        if isinstance(routed, Response):
            return routed
        out = await state.router.explain(routed[2])
        model = routed[1].get("model")
        pool = state.models.pool(model, state.registry.healthy(), state.registry.all()) or []
        lora = state.models.adapter(model, pool)
        out["model"] = {
            "requested": model,
            "pool": [i.url for i in pool],  # candidates: those of it not busy
            "lora": lora[0] if lora else None,
        }
        out["admission"] = state.admission.describe(pool)
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
        parsed = await _read_json(request, 64 * 1024)
        if isinstance(parsed, Response):
            return parsed
        _, data = parsed
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

    return app
