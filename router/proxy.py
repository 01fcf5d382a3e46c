"""Forward a request to the ranked instances: retry until the first byte, then stream.

A forward that fails before the instance sends its first body byte (connect error, read
error, 5xx, instance gone) is retried on the next instance in the ranking: nothing has
reached the client yet, so nothing is lost. A connection that dropped without an answer
(typically a pooled keep-alive connection the engine closed as idle) earns its instance
one more try once the ranking is exhausted, so a one-engine deployment does not 503 on it.
Once the first byte is in, the response is committed and passed through chunk by chunk,
unbuffered; if the instance dies mid-stream the client gets an SSE error chunk (streams)
and the connection ends.

While passing through, the tail of the body is kept (bounded) to read the engine's
``usage.kv_hit`` at the end and compare it with the prediction (exactness metrics).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, NamedTuple

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.decide import RouteDecision
from router.instances import Instance, InstanceRegistry
from router.metrics import RouterMetrics
from router.policy import Policy

__all__ = ["Forwarder", "error_response"]

log = logging.getLogger(__name__)

_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te"}
_PASS_BACK = ("content-type", "cache-control")
_TAIL = 64 * 1024
# Transport errors that mean "the connection went away before any answer", not "refused".
_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class _Failure(NamedTuple):
    message: str
    dropped: bool  # the connection dropped before the first byte: worth one more try


def error_response(message: str, status: int, err_type: str = "BadRequestError") -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def parse_usage(tail: bytes, streaming: bool) -> tuple[int, int] | None:
    """``(gpu_tokens, cpu_tokens)`` the engine reported, from the end of its body."""
    try:
        if streaming:
            for line in reversed(tail.split(b"\n")):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    break
            else:
                return None
        else:
            usage = json.loads(tail).get("usage") or {}
    except (ValueError, AttributeError):
        return None
    kv = usage.get("kv_hit")
    if isinstance(kv, dict):
        return int(kv.get("gpu_tokens", 0)), int(kv.get("cpu_tokens", 0))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return (int(cached), 0) if isinstance(cached, int) else None


class Forwarder:
    def __init__(
        self,
        client: httpx.AsyncClient,
        registry: InstanceRegistry,
        policy: Policy,
        metrics: RouterMetrics,
        *,
        max_retries: int = 2,
        on_routed: Callable[[RouteDecision, str], None] | None = None,
        on_done: Callable[[RouteDecision, str], None] | None = None,
    ) -> None:
        self.client = client
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.max_retries = max_retries
        self.on_routed = on_routed
        self.on_done = on_done

    async def forward(
        self,
        path: str,
        raw_body: bytes,
        headers: Mapping[str, str | bytes],
        decision: RouteDecision,
        streaming: bool,
    ) -> Response:
        fwd_headers = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        ranked = decision.decision.ranked[: 1 + self.max_retries]
        last_error = "no instance available"
        dropped: Instance | None = None
        for attempt, url in enumerate(ranked):
            inst = self.registry.get(url)
            if inst is None or not inst.healthy:
                continue
            if attempt:
                self.metrics.retries.labels("next_instance").inc()
            result = await self._try(inst, path, raw_body, fwd_headers, decision, streaming)
            if isinstance(result, Response):
                return result
            last_error = result.message
            if result.dropped and dropped is None:
                dropped = inst
            log.warning("forward to %s failed before first byte: %s", url, result.message)
        if dropped is not None and dropped.healthy:
            self.metrics.retries.labels("same_instance").inc()
            result = await self._try(dropped, path, raw_body, fwd_headers, decision, streaming)
            if isinstance(result, Response):
                return result
            last_error = result.message
        return error_response(
            f"no instance could serve the request: {last_error}", 503, "ServiceUnavailableError"
        )

    async def _try(
        self,
        inst: Instance,
        path: str,
        raw_body: bytes,
        headers: Mapping[str, str | bytes],
        decision: RouteDecision,
        streaming: bool,
    ) -> Response | _Failure:
        url = inst.url
        uncached = decision.uncached(url)
        inst.inflight_requests += 1
        inst.inflight_prefill_tokens += uncached
        self.metrics.inflight.labels(url).set(inst.inflight_requests)
        if self.on_routed:
            self.on_routed(decision, url)
        t0 = time.perf_counter()
        resp: httpx.Response | None = None
        committed = False
        try:
            req = self.client.build_request("POST", url + path, content=raw_body, headers=headers)
            resp = await self.client.send(req, stream=True)
            if resp.status_code >= 500:
                self.metrics.requests.labels(url, "upstream_5xx").inc()
                await self.registry.report(inst, False)
                return _Failure(f"{url} answered {resp.status_code}", False)
            chunks = resp.aiter_raw()
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            committed = True
        except httpx.HTTPError as exc:
            self.metrics.requests.labels(url, "connect_error").inc()
            inst.errors += 1
            # Only a refused connection counts against its health. Under load a read also
            # fails on a pooled connection the engine closed as idle (it finished sending
            # while we were still relaying), and a connect times out when our own event
            # loop lags; two of those would take a healthy engine out of rotation and
            # pile its traffic on the others. A dead engine refuses; probes catch the rest.
            if isinstance(exc, httpx.ConnectError):
                await self.registry.report(inst, False)
            return _Failure(f"{type(exc).__name__}: {exc}", isinstance(exc, _DROPPED))
        finally:
            inst.inflight_requests -= 1
            inst.inflight_prefill_tokens -= uncached
            self.metrics.inflight.labels(url).set(inst.inflight_requests)
            if resp is not None and not committed:
                await resp.aclose()
            if not committed and self.on_done:
                self.on_done(decision, url)  # this try is over; a retry records anew
        ttft = time.perf_counter() - t0
        self.metrics.ttft.labels(url).observe(ttft)
        if streaming and resp.status_code == 200:
            part = decision.decision.breakdown.get(url)
            if part is not None:
                self.policy.observe(url, part, ttft)
        inst.served += 1
        out_headers = {k: resp.headers[k] for k in _PASS_BACK if k in resp.headers}
        gpu, cpu = decision.predicted(url)
        out_headers["x-kvroute-instance"] = url
        if self.policy.uses_scores:  # load-only policies predict nothing
            out_headers["x-kvroute-predicted-hit"] = str(gpu + cpu)
        outcome = "ok" if resp.status_code < 400 else "upstream_4xx"
        self.metrics.requests.labels(url, outcome).inc()
        return StreamingResponse(
            self._relay(inst, resp, first, chunks, decision, streaming and resp.status_code < 400),
            status_code=resp.status_code,
            headers=out_headers,
        )

    async def _relay(
        self,
        inst: Instance,
        resp: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
        decision: RouteDecision,
        streaming: bool,
    ) -> AsyncIterator[bytes]:
        inst.running_requests += 1
        self.metrics.running.labels(inst.url).set(inst.running_requests)
        tail = bytearray(first[-_TAIL:])
        complete = False
        try:
            if first:
                yield first
            try:
                async for chunk in chunks:
                    tail += chunk
                    if len(tail) > 2 * _TAIL:
                        del tail[:-_TAIL]
                    yield chunk
                complete = True
            except httpx.HTTPError as exc:
                self.metrics.requests.labels(inst.url, "broken_stream").inc()
                log.warning("stream from %s broke: %s", inst.url, exc)
                if streaming:
                    err = {
                        "error": {
                            "message": f"upstream instance failed mid-stream: {exc}",
                            "type": "ServiceUnavailableError",
                            "param": None,
                            "code": 503,
                        }
                    }
                    yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            inst.running_requests -= 1
            self.metrics.running.labels(inst.url).set(inst.running_requests)
            await resp.aclose()
            if self.on_done:
                self.on_done(decision, inst.url)
        if complete and resp.status_code == 200 and self.policy.uses_scores:
            reported = parse_usage(bytes(tail), streaming)
            if reported is not None:
                self.metrics.observe_prediction(decision.predicted(inst.url), reported)


def request_headers(headers: Any) -> dict[str, bytes]:
    """The client's headers minus hop-by-hop ones, values as the bytes received (ASGI
    servers decode them as latin-1): a non-ASCII value is passed on, never a 500."""
    return {k: v.encode("latin-1") for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
