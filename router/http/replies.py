"""Every reply the router sends itself, and the one OpenAI error body.

The layers below (the fleet, the decision) return results -- ``Rejected``, None for an
unknown model, a ``RouteDecision`` -- and the data plane turns them into HTTP here, so an
error has one shape wherever it is raised: vLLM's ``ErrorResponse``
(``{"error": {"message", "type", "param", "code"}}``). ``Reply`` is what the proxy path
writes over raw ASGI; ``as_response`` hands the same bytes to FastAPI's endpoints.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from router.fleet.admission import Rejected

__all__ = [
    "Receive",
    "Reply",
    "Send",
    "as_response",
    "error_body",
    "error_reply",
    "json_reply",
    "rejected_reply",
    "stream_error_chunk",
    "unknown_model_reply",
]

# ASGI's callables, as starlette spells them (messages are mutable mappings).
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

_JSON = (b"content-type", b"application/json")


@dataclass(slots=True, eq=False)
class Reply:
    """An answer ready to send over ASGI: status, headers, body (or a relay). ``after``
    runs once it is sent (or sending failed): bookkeeping the client need not wait for."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    relay: Callable[[Send, Receive], Awaitable[None]] | None = None
    after: Callable[[], None] | None = None

    async def send(self, send: Send, receive: Receive) -> None:
        try:
            if self.relay is not None:
                await self.relay(send, receive)
                return
            headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
            await send({"type": "http.response.start", "status": self.status, "headers": headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            if self.after is not None:
                self.after()


def error_body(
    message: str, status: int, err_type: str = "BadRequestError", param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object vLLM answers with."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_reply(
    message: str,
    status: int,
    err_type: str = "BadRequestError",
    *,
    param: str | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> Reply:
    body = json.dumps(error_body(message, status, err_type, param)).encode()
    return Reply(status, [_JSON, *headers], body)


def json_reply(content: Any, status: int = 200) -> Reply:
    return Reply(status, [_JSON], json.dumps(content).encode())


def rejected_reply(r: Rejected) -> Reply:
    """Admission turned the request away: 429 with ``Retry-After``."""
    retry = ((b"retry-after", str(r.retry_after_s).encode()),)
    return error_reply(r.message, 429, "RateLimitError", headers=retry)


def unknown_model_reply(model: str) -> Reply:
    """vLLM's answer for a model it does not serve (``OpenAIModelRegistry.check_model``)."""
    return error_reply(f"The model `{model}` does not exist.", 404, "NotFoundError", param="model")


def stream_error_chunk(message: str) -> bytes:
    """The SSE chunk that ends a stream whose instance failed after its first byte."""
    return f"data: {json.dumps(error_body(message, 503, 'ServiceUnavailableError'))}\n\n".encode()


def as_response(reply: Reply) -> Response:
    """``reply`` for a FastAPI endpoint (same status, headers and bytes)."""
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in reply.headers}
    media_type = headers.pop("content-type", "application/json")
    return Response(reply.body, status_code=reply.status, headers=headers, media_type=media_type)
