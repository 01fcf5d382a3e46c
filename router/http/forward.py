"""Forward a request to the ranked instances: retry until the first byte, then stream.

A forward that fails before the instance sends its first body byte (connect error, read
error, 5xx, instance gone) is retried on the next instance in the ranking: nothing has
reached the client yet, so nothing is lost. A connection that dropped without an answer
(typically a pooled keep-alive connection the engine closed as idle) earns its instance
one more try once the ranking is exhausted, so a one-engine deployment does not 503 on it.
Once the first byte is in, the response is committed. A stream is passed through chunk by
chunk, unbuffered; if the instance dies mid-stream the client gets an SSE error chunk and
the connection ends. A non-streaming answer is read whole and sent with its length (no
chunked re-encoding: one write, as the engine sent it).

The hot path runs on ``router.http.upstream`` (pooled keep-alive HTTP/1.1 on asyncio
protocols and httptools: the cheapest client measured, docs/design/cost-policy.md).
While passing through, the tail of the body is kept (bounded) to read the engine's
``usage.kv_hit`` at the end and compare it with the prediction (exactness metrics).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec

from router.decision.decide import RouteDecision
from router.decision.policy import Policy
from router.decision.request import RoutedRequest
from router.fleet.instances import Instance, InstanceRegistry
from router.http.replies import Receive, Reply, Send, error_reply, stream_error_chunk
from router.http.upstream import (
    ConnectRefused,
    Dropped,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from router.metrics import RouterMetrics

__all__ = ["Forwarder", "parse_usage", "request_headers"]

log = logging.getLogger(__name__)

HOP_HEADERS = frozenset(
    {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
     b"expect", b"upgrade"}
)  # fmt: skip
_PASS_BACK = ("content-type", "cache-control")
_TAIL = 64 * 1024
_FAILED = (UpstreamError, TimeoutError, OSError)


class _Failure(NamedTuple):
    message: str
    dropped: bool  # the connection dropped before the first byte: worth one more try


class _WithUsage(msgspec.Struct):
    """An OpenAI response (or stream chunk), read for its ``usage`` only: msgspec skips the
    rest without building it (~6x faster than ``json.loads`` on every answer)."""

    usage: dict[str, Any] | None = None


_usage_of = msgspec.json.Decoder(_WithUsage).decode


def parse_usage(tail: bytes, streaming: bool) -> tuple[int, int] | None:
    """``(gpu_tokens, cpu_tokens)`` the engine reported, from the end of its body."""
    try:
        if streaming:
            for line in reversed(tail.split(b"\n")):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = _usage_of(line[6:]).usage or {}
                    break
            else:
                return None
        else:
            usage = _usage_of(tail).usage or {}
    except msgspec.DecodeError:  # not JSON, not an object, a usage that is not one
        return None
    kv = usage.get("kv_hit")
    if isinstance(kv, dict):
        gpu, cpu = kv.get("gpu_tokens", 0), kv.get("cpu_tokens", 0)
        return (gpu, cpu) if type(gpu) is int and type(cpu) is int else None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (cached, 0) if type(cached) is int else None


class Forwarder:
    def __init__(
        self,
        registry: InstanceRegistry,
        policy: Policy,
        metrics: RouterMetrics,
        pool: UpstreamPool,
        *,
        max_retries: int,  # router.config.UpstreamSettings.max_retries
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.pool = pool
        self.max_retries = max_retries

    async def forward(
        self,
        path: str,
        raw_body: bytes,
        headers: list[tuple[bytes, bytes]],
        request: RoutedRequest,
        streaming: bool,
    ) -> Reply:
        """Try the ranked instances in turn until one answers (its reply), else 503.
        ``request`` hears of each try: ``sent`` once written, ``ended`` once over."""
        ranked = request.decision.decision.ranked[: 1 + self.max_retries]
        last_error = "no instance available"
        dropped: Instance | None = None
        for attempt, url in enumerate(ranked):
            inst = self.registry.get(url)
            if inst is None or not inst.healthy:
                continue
            if attempt:
                self.metrics.retry_next.inc()
            result = await self._try(inst, path, raw_body, headers, request, streaming)
            if isinstance(result, Reply):
                return result
            last_error = result.message
            if result.dropped and dropped is None:
                dropped = inst
            log.warning("forward to %s failed before first byte: %s", url, result.message)
        if dropped is not None and dropped.healthy:
            self.metrics.retry_same.inc()
            result = await self._try(dropped, path, raw_body, headers, request, streaming)
            if isinstance(result, Reply):
                return result
            last_error = result.message
        return error_reply(
            f"no instance could serve the request: {last_error}", 503, "ServiceUnavailableError"
        )

    async def _try(
        self,
        inst: Instance,
        path: str,
        raw_body: bytes,
        headers: list[tuple[bytes, bytes]],
        request: RoutedRequest,
        streaming: bool,
    ) -> Reply | _Failure:
        url = inst.url
        decision = request.decision
        m = self.metrics.instance(url)
        uncached = decision.uncached(url)
        inst.inflight_requests += 1
        inst.inflight_prefill_tokens += uncached
        m.inflight.set(inst.inflight_requests)
        t0 = time.perf_counter()
        resp: UpstreamResponse | None = None
        committed = False
        first = b""
        try:
            if inst.route_headers:  # a data-parallel rank: vLLM's X-data-parallel-rank
                headers = [h for h in headers if h[0].lower() != b"x-data-parallel-rank"]
                headers += inst.route_header_bytes
            resp = await self.pool.post(
                inst.http_url,
                path,
                raw_body,
                headers,
                lambda: request.sent(url),
            )
            t_head = time.perf_counter()
            self.metrics.stage_upstream_headers.observe(t_head - t0)
            if resp.status >= 500:
                m.upstream_5xx.inc()
                await self.registry.report(inst, False)
                return _Failure(f"{url} answered {resp.status}", False)
            if streaming and resp.status < 400:
                first = await resp.readany()
            else:
                first = await resp.read()
                resp.release()  # whole answer in hand: the connection goes back to the pool
            committed = True
        except _FAILED as exc:
            m.connect_error.inc()
            inst.errors += 1
            # Only a refused connection counts against its health. Under load a read also
            # fails on a pooled connection the engine closed as idle (it finished sending
            # while we were still relaying), and a connect times out when our own event
            # loop lags; two of those would take a healthy engine out of rotation and
            # pile its traffic on the others. A dead engine refuses; probes catch the rest.
            if isinstance(exc, ConnectRefused):
                await self.registry.report(inst, False)
            return _Failure(f"{type(exc).__name__}: {exc}", isinstance(exc, Dropped))
        finally:
            inst.inflight_requests -= 1
            inst.inflight_prefill_tokens -= uncached
            m.inflight.set(inst.inflight_requests)
            if resp is not None and not committed:
                resp.close()
            if not committed:
                request.ended(url)  # this try is over; a retry records anew
        ttft = time.perf_counter() - t0
        self.metrics.stage_upstream_first_byte.observe(ttft)
        m.ttft.observe(ttft)
        inst.served += 1
        out = [
            (k.encode(), v.encode("latin-1", "replace"))
            for k in _PASS_BACK
            if (v := resp.headers.get(k)) is not None
        ]
        out.append((b"x-kvroute-instance", url.encode()))
        if self.policy.uses_scores:  # load-only policies predict nothing
            gpu, cpu = decision.predicted(url)
            out.append((b"x-kvroute-predicted-hit", str(gpu + cpu).encode()))
        (m.ok if resp.status < 400 else m.upstream_4xx).inc()
        if streaming and resp.status < 400:
            relay = self._relay(inst, resp, first, request, out, ttft)
            return Reply(resp.status, out, relay=relay)
        status = resp.status

        def after() -> None:  # once the answer is on its way to the client
            self._finish(inst, status, first, decision, streaming=False)
            request.ended(url)

        return Reply(status, out, first, after=after)

    def _relay(
        self,
        inst: Instance,
        resp: UpstreamResponse,
        first: bytes,
        request: RoutedRequest,
        headers: list[tuple[bytes, bytes]],
        ttft: float,
    ) -> Callable[[Send, Receive], Awaitable[None]]:
        decision = request.decision

        async def relay(send: Send, receive: Receive) -> None:
            m = self.metrics.instance(inst.url)
            inst.running_requests += 1
            m.running.set(inst.running_requests)
            tail = bytearray(first[-_TAIL:])
            complete = ended = gone = False
            t0 = time.perf_counter()
            me: asyncio.Task[Any] | None = None
            watcher: asyncio.Task[None] | None = None

            async def watch() -> None:  # the client went away: stop relaying (and reading)
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not ended and me is not None:
                    gone = True
                    me.cancel()

            try:
                start = {"type": "http.response.start", "status": resp.status, "headers": headers}
                await send(start)
                if first:
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                if resp.status == 200:  # calibrate once the first chunk is on its way
                    part = decision.decision.breakdown.get(inst.url)
                    if part is not None:
                        self.policy.observe(inst.url, part, ttft)
                try:
                    while True:
                        # Watch the client only once the relay would wait on the engine:
                        # an answer already here (a short stream) is sent without a task.
                        if watcher is None and not resp.ready():
                            me = asyncio.current_task()
                            watcher = asyncio.create_task(watch())
                        if not (chunk := await resp.readany()):
                            break
                        tail += chunk
                        if len(tail) > 2 * _TAIL:
                            del tail[:-_TAIL]
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    complete = True
                except _FAILED as exc:
                    m.broken_stream.inc()
                    log.warning("stream from %s broke: %s", inst.url, exc)
                    chunk = stream_error_chunk(f"upstream instance failed mid-stream: {exc}")
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                ended = True
                await send({"type": "http.response.body", "body": b""})
            except asyncio.CancelledError:
                if not gone or me is None:
                    raise
                me.uncancel()  # the client left; the answer is simply not wanted any more
            finally:
                if watcher is not None:
                    watcher.cancel()
                inst.running_requests -= 1
                m.running.set(inst.running_requests)
                resp.release() if complete else resp.close()
                self.metrics.stage_relay.observe(time.perf_counter() - t0)
                request.ended(inst.url)
            if complete:
                self._finish(inst, resp.status, bytes(tail), decision, streaming=True)

        return relay

    def _finish(
        self, inst: Instance, status: int, tail: bytes, decision: RouteDecision, *, streaming: bool
    ) -> None:
        """Compare the engine's reported hit with the prediction (exactness metrics)."""
        if status == 200 and self.policy.uses_scores:
            reported = parse_usage(tail[-_TAIL:], streaming)
            if reported is not None:
                self.metrics.observe_prediction(decision.predicted(inst.url), reported)


def request_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers minus hop-by-hop ones, as the bytes received (a non-ASCII value
    is passed on, never a 500)."""
    return [
        (k, v) for k, v in raw if k.lower() not in HOP_HEADERS and b"\r" not in v and b"\n" not in v
    ]
