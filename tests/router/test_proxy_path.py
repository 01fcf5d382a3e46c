"""The proxy hot path: raw ASGI endpoints, our pooled upstream client, bodies passed
through byte for byte, per-stage and index metrics exported, one ``build_router``."""

from __future__ import annotations

import asyncio
import json

import httpx
from routerkit import ScriptedUpstream

from router.build import build_router
from router.config import RouterSettings
from router.decision.layout import LayoutRegistry
from router.http.app import create_app
from router.index.instrumented import InstrumentedIndex
from router.index.memory import MemoryIndex
from router.state import RouterState

_ANSWER = json.dumps(
    {"choices": [{"text": "ok"}], "usage": {"kv_hit": {"gpu_tokens": 0, "cpu_tokens": 0}}}
).encode()
_SSE = b'data: {"choices":[{"text":"o"}]}\n\ndata: {"choices":[],"usage":{"kv_hit":' + (
    b'{"gpu_tokens":0,"cpu_tokens":0}}}\n\ndata: [DONE]\n\n'
)


class Upstream(ScriptedUpstream):
    """JSON with Content-Length, or chunked SSE for streams; keeps each POST's raw head."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[bytes] = []

    async def answer(self, head: bytes, body: bytes, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        self.heads.append(head)
        if json.loads(body).get("stream") is True:
            msg = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            msg += b"transfer-encoding: chunked\r\n\r\n"
            for part in (_SSE[:20], _SSE[20:]):
                msg += b"%x\r\n%s\r\n" % (len(part), part)
            writer.write(msg + b"0\r\n\r\n")
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(_ANSWER), _ANSWER)
            )
        return True


async def _with_router(upstream: Upstream, fn):  # type: ignore[no-untyped-def]
    state = RouterState(RouterSettings(instances=[upstream.url], engine_metrics=False))
    await state.start()
    try:
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await fn(c)
    finally:
        await state.stop()


async def test_answers_pass_through_byte_for_byte_on_one_kept_alive_connection() -> None:
    async def run(c: httpx.AsyncClient) -> list[httpx.Response]:
        plain = [
            await c.post("/v1/completions", json={"prompt": f"a prompt of more than one block {i}"})
            for i in range(4)
        ]
        stream = await c.post(
            "/v1/completions", json={"prompt": "a prompt of more than one block", "stream": True}
        )
        return [*plain, stream, await c.get("/metrics")]

    async with Upstream() as up:
        *plain, stream, metrics = await _with_router(up, run)
    for r in plain:
        assert r.status_code == 200 and r.content == _ANSWER
        assert r.headers["content-length"] == str(len(_ANSWER))  # not re-chunked
        assert r.headers["x-kvroute-instance"] == up.url
    assert stream.content == _SSE and stream.headers["content-type"] == "text/event-stream"
    assert up.connections == 1
    text = metrics.text
    # Every answer's usage was read and compared with the prediction.
    compared = [ln for ln in text.splitlines() if ln.startswith("kvroute_router_predictions_t")]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in compared) == 5
    for stage in ("parse", "tokenize", "hash", "score", "choose", "upstream_first_byte"):
        assert f'kvroute_router_stage_seconds_count{{stage="{stage}"}} 5.0' in text
    assert 'kvroute_router_stage_seconds_count{stage="relay"} 1.0' in text
    assert "kvroute_index_lookup_seconds_count 5.0" in text  # the instrumented index


async def test_header_bytes_reach_the_engine_as_sent_and_hop_headers_do_not() -> None:
    async def run(c: httpx.AsyncClient) -> httpx.Response:
        headers = {"x-odd": "caf\xe9".encode("latin-1"), "connection": "keep-alive"}
        return await c.post("/v1/completions", json={"prompt": "x"}, headers=headers)

    async with Upstream() as up:
        r = await _with_router(up, run)
    assert r.status_code == 200
    head = up.heads[0]
    assert b"x-odd: caf\xe9\r\n" in head
    assert b"connection:" not in head.lower()
    assert head.lower().count(b"content-length:") == 1


async def test_malformed_bodies_get_a_400_with_the_reason() -> None:
    async def run(c: httpx.AsyncClient) -> list[httpx.Response]:
        bodies = [b"{not json", b"[1, 2]", b'{"prompt": "\xff"}', b'{"max_tokens": 1}']
        out = [await c.post("/v1/completions", content=b) for b in bodies]
        out.append(await c.post("/v1/chat/completions", json={"messages": []}))
        out.append(await c.post("/v1/completions", json={"prompt": "x", "stream": "yes"}))
        return out

    async with Upstream() as up:
        answers = await _with_router(up, run)
    messages = [r.json()["error"]["message"] for r in answers]
    assert [r.status_code for r in answers] == [400] * 6
    assert messages[0].startswith("invalid JSON body")
    assert messages[1] == "request body must be a JSON object"
    assert messages[2].startswith("invalid JSON body")
    assert messages[3] == "missing required field 'prompt'"
    assert messages[4] == "'messages' must be a non-empty list"
    assert messages[5] == "'stream' must be a boolean"
    assert up.heads == []  # nothing malformed was forwarded


def test_build_router_pairs_the_full_only_baseline_and_instruments_the_index_once() -> None:
    index = MemoryIndex()
    baseline = build_router(
        RouterSettings(policy="prefix_full_only"), index=index, layouts=LayoutRegistry(),
        registry=None,
    )  # fmt: skip
    cost = build_router(
        RouterSettings(policy="cost"), index=baseline.index, layouts=LayoutRegistry(),
        registry=None,
    )  # fmt: skip
    assert baseline.scorer.full_only and not cost.scorer.full_only
    assert baseline.policy.name == "prefix_full_only" and cost.policy.name == "cost"
    assert isinstance(baseline.index, InstrumentedIndex) and baseline.index.inner is index
    assert cost.index is baseline.index  # an instrumented index is not wrapped again


class HeldUpstream(Upstream):
    """Holds the first POST until ``release`` is set (``got``: it arrived); answers the
    ones that come while it is held at once."""

    def __init__(self) -> None:
        super().__init__()
        self.got = asyncio.Event()
        self.release = asyncio.Event()

    async def answer(self, head: bytes, body: bytes, reader, writer) -> bool:  # type: ignore[no-untyped-def]
        if not self.got.is_set():
            self.got.set()
            await self.release.wait()
        return await super().answer(head, body, reader, writer)


async def test_a_routed_request_is_predicted_on_fresh_and_kept_connections() -> None:
    """Predict-on-route on the proxy path happens as the request is written upstream (on a
    kept-alive connection) or before connecting: a second request with the same prompt,
    sent while the first is held by the engine, is credited with its blocks."""
    up = HeldUpstream()
    async with up:
        state = RouterState(RouterSettings(instances=[up.url], engine_metrics=False))
        await state.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
                for turn in range(2):  # fresh connections, then kept-alive ones
                    prompt = f"turn {turn} " + "a long shared prompt " * 40
                    first = asyncio.create_task(c.post("/v1/completions", json={"prompt": prompt}))
                    await asyncio.wait_for(up.got.wait(), 10)
                    second = await c.post("/v1/completions", json={"prompt": prompt})
                    assert int(second.headers["x-kvroute-predicted-hit"]) > 0, turn
                    up.release.set()
                    assert (await first).status_code == 200
                    up.got.clear()
                    up.release.clear()
                assert up.connections == 2  # the second turn went over kept-alive ones
        finally:
            await state.stop()
