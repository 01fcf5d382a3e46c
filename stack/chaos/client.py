"""Requests through the router, what their answers must be, and probes of its state."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


def scrape(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


# ---- requests and what their answers must be --------------------------------------------


@functools.cache
def _filler() -> tuple[Any, list[int]]:
    # engine_adapter imports torch: a second or more, so scenarios call this before timing.
    from engine_adapter.sim.core import FILLER_TEXT
    from events.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return tok, tok.encode(FILLER_TEXT)


def expected_text(prompt: str, max_tokens: int) -> str:
    """The simulated engine's output for a completion of ``prompt`` (byte tokenizer): its
    filler text, starting at an offset given by the prompt length."""
    tok, filler = _filler()
    n = len(tok.encode(prompt))
    return tok.decode([filler[(i + n) % len(filler)] for i in range(max_tokens)])


@dataclass
class StreamOutcome:
    """What one request through the router got back."""

    index: int
    stream: bool
    status: int | None = None
    instance: str | None = None  # x-kvroute-instance
    first_byte_s: float | None = None  # since the request was sent
    done: bool = False  # saw data: [DONE]
    error_chunk: bool = False  # saw data: {"error": ...}
    text: str = ""
    expected: str = ""
    ids: set[str] = field(default_factory=set)
    fingerprints: set[str] = field(default_factory=set)
    exception: str | None = None
    started_at: float = 0.0
    ended_at: float = 0.0

    @property
    def ok(self) -> bool:
        """Complete, correct, one response id and one engine throughout."""
        return (
            self.status == 200
            and self.exception is None
            and not self.error_chunk
            and (self.done or not self.stream)
            and self.text == self.expected
            and len(self.ids) == 1
            and len(self.fingerprints) == 1
        )

    @property
    def failed_cleanly(self) -> bool:
        """A stream that broke after its first byte and said so with an SSE error chunk."""
        return self.stream and self.status == 200 and self.error_chunk and self.exception is None

    @property
    def lost(self) -> bool:
        return not (self.ok or self.failed_cleanly)

    def describe(self) -> str:
        return (
            f"#{self.index} stream={self.stream} status={self.status} via={self.instance} "
            f"done={self.done} error_chunk={self.error_chunk} ids={len(self.ids)} "
            f"fingerprints={len(self.fingerprints)} text_ok={self.text == self.expected} "
            f"exception={self.exception}"
        )


async def send_completion(
    client: httpx.AsyncClient,
    router: str,
    index: int,
    prompt: str,
    max_tokens: int,
    *,
    stream: bool = True,
    timeout: float = 60.0,
) -> StreamOutcome:
    """POST one completion, read it to the end, and record what came back."""
    out = StreamOutcome(index, stream, expected=expected_text(prompt, max_tokens))
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    t0 = out.started_at = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{router}/v1/completions", json=body) as resp:
                out.status = resp.status_code
                out.instance = resp.headers.get("x-kvroute-instance")
                if not stream or resp.status_code != 200:
                    raw = await resp.aread()
                    out.first_byte_s = time.monotonic() - t0
                    _read_json_answer(out, raw)
                else:
                    async for line in resp.aiter_lines():
                        if out.first_byte_s is None:
                            out.first_byte_s = time.monotonic() - t0
                        _read_sse_line(out, line)
    except Exception as exc:  # a lost request: recorded, judged by the caller
        out.exception = f"{type(exc).__name__}: {exc}"
    out.ended_at = time.monotonic()
    return out


def _read_json_answer(out: StreamOutcome, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        out.exception = f"non-JSON answer: {raw[:200]!r}"
        return
    if out.status != 200:
        out.error_chunk = "error" in data
        return
    out.ids.add(data.get("id"))
    out.fingerprints.add(data.get("system_fingerprint"))
    out.text = data["choices"][0]["text"]
    out.done = True


def _read_sse_line(out: StreamOutcome, line: str) -> None:
    if not line.startswith("data: "):
        return
    payload = line[6:]
    if payload == "[DONE]":
        out.done = True
        return
    if out.done:
        out.exception = "data after [DONE]"
        return
    chunk = json.loads(payload)
    if "error" in chunk:
        out.error_chunk = True
        return
    out.ids.add(chunk.get("id"))
    out.fingerprints.add(chunk.get("system_fingerprint"))
    for choice in chunk.get("choices") or ():
        out.text += choice.get("text") or ""


def new_client(connections: int = 100, timeout: float = 60.0) -> httpx.AsyncClient:
    _filler()  # not inside a timed run
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=10.0),
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them: reusing
        # one the server is closing loses the request (HTTP/1.1's keep-alive race).
        limits=httpx.Limits(
            max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=2
        ),
    )


async def route_view(client: httpx.AsyncClient, router: str, prompt: str) -> dict[str, Any]:
    """``/debug/route`` for ``prompt`` (nothing is forwarded)."""
    r = await client.post(f"{router}/debug/route", json={"prompt": prompt}, timeout=10)
    r.raise_for_status()
    return r.json()


def index_tokens(view: dict[str, Any], instance: str) -> int | None:
    """Tokens the index alone (no speculation) credits ``instance`` with; None: not a
    candidate (down)."""
    for c in view["candidates"]:
        if c["instance"] == instance:
            return sum(c["index_score"])
    return None


async def wait_for(
    check: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "condition"
) -> float:
    """Poll ``await check()`` until truthy; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if await check():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


async def metrics_text(client: httpx.AsyncClient, url: str) -> str:
    return (await client.get(f"{url}/metrics", timeout=10)).text


# ---- probes of the router's view ---------------------------------------------------


async def holds(client: httpx.AsyncClient, router: str, prompt: str, instance: str) -> bool:
    return (index_tokens(await route_view(client, router, prompt), instance) or 0) > 0


async def running_on(client: httpx.AsyncClient, router: str, instance: str) -> bool:
    text = await metrics_text(client, router)
    return scrape(text, "kvroute_router_running_requests", instance=instance) >= 1


async def healthy_is(client: httpx.AsyncClient, router: str, instance: str, v: float) -> bool:
    text = await metrics_text(client, router)
    return scrape(text, "kvroute_router_instance_healthy", instance=instance) == v


async def index_ok(client: httpx.AsyncClient, router: str, prompt: str) -> bool:
    return bool((await route_view(client, router, prompt))["index_ok"])
