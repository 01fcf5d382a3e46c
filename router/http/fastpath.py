"""The OpenAI proxy endpoints as a raw ASGI layer in front of FastAPI.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are the hot path: they skip
FastAPI's routing, request objects and response classes (a large share of the proxy's
time otherwise), read the body straight from ``receive``, decode only the fields routing
needs (msgspec), and write the answer with ``send``. Everything else -- ``/debug/route``,
admin, metrics, health, the dashboard -- goes on to the FastAPI app. Bad input gets the
4xx OpenAI errors of ``router.http.replies``; the body is forwarded as received.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import msgspec

from router.http.forward import request_headers
from router.http.gate import route_request
from router.http.replies import Receive, Reply, Send, error_reply

if TYPE_CHECKING:
    from fastapi import FastAPI

    from router.dashboard import Dashboard
    from router.state import RouterState

__all__ = ["ProxyEndpoints", "RoutingFields", "parse_body", "read_body"]

_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
_REQUIRED = {"completion": "prompt", "chat": "messages"}
_UNSET: Any = msgspec.UNSET


class RoutingFields(msgspec.Struct):
    """What routing reads of an OpenAI body; every other field is skipped, not built."""

    prompt: Any = _UNSET
    messages: Any = _UNSET
    stream: Any = _UNSET
    cache_salt: Any = _UNSET
    model: Any = _UNSET  # picks the pool (and a LoRA adapter)
    user: Any = _UNSET  # may name a session (session affinity)
    # What changes a prompt's token ids (a model-directory tokenizer renders them as vLLM).
    add_special_tokens: Any = _UNSET
    add_generation_prompt: Any = _UNSET
    continue_final_message: Any = _UNSET
    chat_template_kwargs: Any = _UNSET
    chat_template: Any = _UNSET
    documents: Any = _UNSET
    reasoning_effort: Any = _UNSET
    tools: Any = _UNSET


_decoder = msgspec.json.Decoder(RoutingFields)


async def read_body(scope: MutableMapping[str, Any], receive: Receive, limit: int) -> bytes | Reply:
    """The whole body; 413 before reading more than ``limit`` bytes."""
    for k, v in scope["headers"]:
        if k == b"content-length" and v.isdigit() and int(v) > limit:
            return error_reply(f"request body over {limit} bytes", 413, "RequestTooLarge")
    msg = await receive()
    body: bytes = msg.get("body", b"")
    if not msg.get("more_body"):
        return body
    buf = bytearray(body)
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
        buf += msg.get("body", b"")
        if len(buf) > limit:
            return error_reply(f"request body over {limit} bytes", 413, "RequestTooLarge")
        if not msg.get("more_body"):
            break
    return bytes(buf)


def parse_body(raw: bytes, kind: str | None) -> tuple[str, dict[str, Any]] | Reply:
    """``(kind, routing fields)`` of an OpenAI body, or its 400 (``kind`` None: told by its
    fields, as ``/debug/route`` does)."""
    try:
        f = _decoder.decode(raw)
    except msgspec.ValidationError:
        return error_reply("request body must be a JSON object", 400)
    except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # bad UTF-8, deep nesting
        return error_reply(f"invalid JSON body: {exc}", 400)
    data = {k: v for k in _FIELDS if (v := getattr(f, k)) is not _UNSET}
    if kind is None:
        kind = "chat" if "messages" in data else "completion"
    field = _REQUIRED[kind]
    if field not in data:
        return error_reply(f"missing required field '{field}'", 400)
    value = data[field]
    if kind == "chat" and (not isinstance(value, list) or not value):
        return error_reply("'messages' must be a non-empty list", 400)
    if kind == "completion" and not isinstance(value, str | list):
        return error_reply("'prompt' must be a string or a list of token ids", 400)
    if "stream" in data and not isinstance(data["stream"], bool):
        return error_reply("'stream' must be a boolean", 400)
    return kind, data


_FIELDS = RoutingFields.__struct_fields__


class ProxyEndpoints:
    """ASGI middleware: the two proxy endpoints here, the rest to ``app``."""

    def __init__(
        self, app: FastAPI, state: RouterState, dashboard: Dashboard | None = None
    ) -> None:
        self.app = app
        self.state = state
        self.dashboard = dashboard
        self.limit = state.settings.max_body_bytes

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = _PATHS.get(scope["path"])
            if kind is not None:
                reply = await self.proxy(scope, receive, kind)
                await reply.send(send, receive)
                return
        await self.app(scope, receive, send)

    async def proxy(self, scope: MutableMapping[str, Any], receive: Receive, kind: str) -> Reply:
        state = self.state
        t0 = time.perf_counter()
        raw = await read_body(scope, receive, self.limit)
        if isinstance(raw, Reply):
            return raw
        parsed = parse_body(raw, kind)
        if isinstance(parsed, Reply):
            return parsed
        _, data = parsed
        state.metrics.stage_parse.observe(time.perf_counter() - t0)
        request = await route_request(state, data, kind, scope["headers"], dashboard=self.dashboard)
        if isinstance(request, Reply):
            return request
        try:
            return await state.forwarder.forward(
                scope["path"],
                raw,
                request_headers(scope["headers"]),
                request,
                data.get("stream") is True,
            )
        finally:
            request.release()  # a forward started released it already; else: free it
