"""A minimal OpenAI-shaped upstream for the overhead benchmark: answers in microseconds, so
what a router adds is not hidden behind an engine's own time.

``python -m bench.replay.upstream PORT``: ``GET /health``; ``POST /v1/completions`` and
``/v1/chat/completions`` -> a fixed completion (``Content-Length``), or four SSE chunks when
the body says ``"stream": true``; ``POST .../render`` and ``/tokenize`` -> the prompt's bytes
as token ids (what vllm-router asks every worker for). Anything else: 404. asyncio
protocol + httptools on uvloop: the cheapest HTTP/1.1 server Python has.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httptools
import uvloop

_COMPLETION = json.dumps(
    {
        "id": "cmpl-0",
        "object": "text_completion",
        "model": "kvroute-sim",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()
_CHUNK = b'data: {"id":"cmpl-0","object":"text_completion","choices":[{"index":0,"text":"ok"}]}\n\n'
_SSE = _CHUNK * 3 + b"data: [DONE]\n\n"


def _response(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype
    return head + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _chunked(body: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
    return head + b"\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"


class RequestProtocol(asyncio.Protocol):
    """An HTTP/1.1 server connection on httptools' parser: collects each request's URL and
    body for ``on_message_complete`` (headers are skipped unless a subclass reads them)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body += body


class _Http(RequestProtocol):
    def on_message_complete(self) -> None:
        assert self.transport is not None
        path, body = self.url.split(b"?")[0], bytes(self.body)
        self.body.clear()
        if path == b"/health":
            out = _response(b"200 OK", b"{}")
        elif path in (b"/v1/completions", b"/v1/chat/completions"):
            streaming = b'"stream": true' in body or b'"stream":true' in body
            out = _chunked(_SSE) if streaming else _response(b"200 OK", _COMPLETION)
        elif path.endswith(b"/render") or path == b"/tokenize":
            prompt = json.loads(body).get("prompt") or json.dumps(json.loads(body))
            ids = list(str(prompt).encode())
            key = b"token_ids" if path.endswith(b"/render") else b"tokens"
            payload = b'{"' + key + b'": ' + json.dumps(ids).encode()
            out = _response(b"200 OK", payload + b', "count": %d}' % len(ids))
        else:
            out = _response(b"404 Not Found", b'{"error": "not found"}')
        self.transport.write(out)


async def _main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(_main(int(sys.argv[1])))
