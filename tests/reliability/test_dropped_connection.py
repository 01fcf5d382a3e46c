"""A connection that drops before any answer -- what a pooled keep-alive connection looks
like when the engine closed it as idle -- is retried on the same instance once the ranking
is exhausted: a one-engine deployment answers instead of 503ing."""

from __future__ import annotations

import json

import httpx
from routerkit import ScriptedUpstream

from router.config import RouterSettings
from router.http.app import create_app
from router.state import RouterState

ANSWER = {
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "kvroute-sim",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


class DroppingUpstream(ScriptedUpstream):
    """Reads the first ``drops`` POSTs and closes the connection without a byte of answer;
    every later POST gets a small JSON answer."""

    def __init__(self, drops: int) -> None:
        super().__init__()
        self.drops = drops
        self.posts = 0

    async def answer(self, head: bytes, body: bytes, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        self.posts += 1
        if self.posts <= self.drops:
            return False  # drop: close without answering
        data = json.dumps(ANSWER).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        return True


async def _post_through_router(upstream: DroppingUpstream) -> httpx.Response:
    settings = RouterSettings(instances=[upstream.url], engine_metrics=False, max_retries=2)
    state = RouterState(settings)
    await state.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(state)), base_url="http://router"
        ) as c:
            return await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    finally:
        await state.stop()


async def test_one_engine_that_drops_a_connection_is_tried_once_more() -> None:
    async with DroppingUpstream(drops=1) as upstream:
        resp = await _post_through_router(upstream)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "ok"
    assert resp.headers["x-kvroute-instance"] == upstream.url
    assert upstream.posts == 2


async def test_an_engine_that_keeps_dropping_gets_a_clear_503() -> None:
    async with DroppingUpstream(drops=10) as upstream:
        resp = await _post_through_router(upstream)
    assert resp.status_code == 503
    assert "no instance could serve the request" in resp.json()["error"]["message"]
    assert upstream.posts == 2  # the forward and exactly one more try, no retry storm
