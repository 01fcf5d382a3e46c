"""The instances a router may forward to: their health and router-side load.

Only registered instances are ever contacted (no URL from a request is followed). Health
checks mark an instance down after ``failures`` consecutive failed probes and up after
``successes`` good ones; a down instance gets no traffic and its residency is ignored by
the scorer. Each probe also reads the engine's waiting queue from ``/metrics`` when
exported (``vllm:num_requests_waiting``), which the cost policy adds to its queue term.

Probes share the routing event loop, so they must be cheap at fleet scale: with a
``prober`` (the data plane's keep-alive client, ``router.http.upstream``) a probe is two GETs
on a kept connection; through httpx's shared pool every request scanned every pooled
connection, and 96 instances cost 11-24% of a core while idle. The served models
(``HealthListener.probed_up``) are re-read when an instance comes up and then every
``models_interval_s``, not on every probe. What the checker finds is told to one typed
listener given at construction (the router's composition root, ``router.state``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

import httpx

from router.fleet.engine_metrics import parse_engine_metrics
from router.fleet.specs import InstanceSpec
from router.http.upstream import Dropped, UpstreamError, UpstreamPool

__all__ = ["HealthListener", "Instance", "InstanceRegistry"]

log = logging.getLogger(__name__)

_WAITING = re.compile(rb"^vllm:num_requests_waiting(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_CACHE_INFO = re.compile(rb"^vllm:cache_config_info\{([^}]*)\}", re.M)
# vLLM 0.33 labels the size it settled on ``effective_attention_block_size``; older ones
# only ``block_size``.
_BLOCK_SIZE = (
    re.compile(rb'\beffective_attention_block_size="(\d+)"'),
    re.compile(rb'(?:^|,)block_size="(\d+)"'),
)


@dataclass(eq=False)
class Instance:
    spec: InstanceSpec
    healthy: bool = True  # optimistic until probes say otherwise
    fails: int = 0
    oks: int = 0
    inflight_requests: int = 0  # forwarded, first byte not yet received
    inflight_prefill_tokens: int = 0
    running_requests: int = 0  # streams still open
    # The same three counts on the other router replicas sharing this one's Redis index
    # (``router.prediction.shared``; 0 with one replica): the policy adds them.
    peer_inflight_requests: int = 0
    peer_inflight_prefill_tokens: int = 0
    peer_running_requests: int = 0
    engine_waiting: int = 0
    engine_block_size: int | None = None  # vllm:cache_config_info, the size vLLM chose
    served: int = 0
    errors: int = 0
    down_since: float | None = None
    models_read_at: float | None = None  # loop time of the last good probe's probed_up
    # The engine's own load, KV usage and prefix-cache counters from its /metrics
    # (``router.fleet.engine_metrics``), as of the last probe; shown by /dashboard.
    engine_stats: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def http_url(self) -> str:
        return self.spec.http_url

    @property
    def route_headers(self) -> dict[str, str]:
        """Headers that send a request to this target: vLLM's rank choice for a DP rank."""
        rank = self.spec.dp_rank
        return {} if rank is None else {"x-data-parallel-rank": str(rank)}

    @property
    def route_header_bytes(self) -> list[tuple[bytes, bytes]]:
        """``route_headers`` as the proxy writes them."""
        return [(k.encode(), v.encode()) for k, v in self.route_headers.items()]


class HealthListener(Protocol):
    """Told, on the routing loop, what the health checker finds (``router.state``)."""

    async def health_changed(self, inst: Instance, up: bool) -> None:
        """``inst`` crossed a threshold: it is now up (``up``) or down."""

    async def probed_up(self, inst: Instance) -> None:
        """A good probe of ``inst`` that is due its served models' re-read (it came up, or
        ``models_interval_s`` passed)."""

    def block_size_seen(self, url: str, block_size: int) -> None:
        """The engine's /metrics named a block size other than the one last seen."""

    def probe_round_done(self) -> None:
        """Every instance was probed once more (admission re-checks its thresholds)."""


@dataclass(eq=False)
class InstanceRegistry:
    """Registered instances plus a background health checker."""

    client: httpx.AsyncClient
    _: KW_ONLY
    # router.config.HealthSettings's fields (their defaults and bounds are written there).
    interval_s: float
    timeout_s: float
    failures: int  # failed probes in a row that mark an instance down
    successes: int  # good probes in a row that bring it back
    read_metrics: bool = True
    models_interval_s: float = 10.0  # re-read served models (probed_up) at most this often
    prober: UpstreamPool | None = None  # probe with this client (default: ``client``)
    listener: HealthListener | None = None
    _instances: dict[str, Instance] = field(default_factory=dict, init=False, repr=False)
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    # ---- membership -------------------------------------------------------------------

    def add(self, spec: InstanceSpec) -> Instance:
        if spec.url in self._instances:
            raise ValueError(f"instance {spec.url} is already registered")
        inst = self._instances[spec.url] = Instance(spec)
        return inst

    def remove(self, url: str) -> Instance | None:
        return self._instances.pop(url.rstrip("/"), None)

    def get(self, url: str) -> Instance | None:
        return self._instances.get(url)

    def all(self) -> list[Instance]:
        return list(self._instances.values())

    def healthy(self) -> list[Instance]:
        return [i for i in self._instances.values() if i.healthy]

    # ---- health -----------------------------------------------------------------------

    async def start(self) -> None:
        await self.probe_all()
        self._task = asyncio.create_task(self._loop(), name="health-checker")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_all()
            except Exception:  # never let the checker die
                log.exception("health check round failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i) for i in self.all()))
        if self.listener is not None:
            self.listener.probe_round_done()

    async def probe(self, inst: Instance) -> bool:
        ok = False
        try:
            status, _ = await self.fetch(inst, "/health")
            ok = status == 200
            if ok and self.read_metrics:
                await self._read_waiting(inst)
            if ok and self.listener is not None and self._models_due(inst):
                inst.models_read_at = asyncio.get_running_loop().time()
                await self.listener.probed_up(inst)
        except (httpx.HTTPError, UpstreamError, OSError):  # OSError: TimeoutError too
            ok = False
        await self.report(inst, ok)
        return ok

    def _models_due(self, inst: Instance) -> bool:
        """Served models are re-read when the instance comes (back) up -- it may have
        restarted with others -- and every ``models_interval_s`` (adapters loaded later)."""
        if not inst.healthy or inst.models_read_at is None:
            return True
        return asyncio.get_running_loop().time() - inst.models_read_at >= self.models_interval_s

    async def fetch(self, inst: Instance, path: str) -> tuple[int, bytes]:
        """``GET`` ``path`` of the instance: (status, body)."""
        if self.prober is None:
            r = await self.client.get(f"{inst.http_url}{path}", timeout=self.timeout_s)
            return r.status_code, r.content
        for attempt in range(2):
            try:
                resp = await self.prober.get(inst.http_url, path)
            except Dropped:  # a kept connection the engine had closed: one fresh try
                if attempt:
                    raise
                continue
            try:
                body = await resp.read()
            except BaseException:
                resp.close()
                raise
            resp.release()
            return resp.status, body
        raise AssertionError("unreachable")

    async def report(self, inst: Instance, ok: bool) -> None:
        """Feed one observation (a probe, or a failed forward) into the thresholds."""
        if ok:
            inst.oks, inst.fails = inst.oks + 1, 0
            if not inst.healthy and inst.oks >= self.successes:
                inst.healthy = True
                inst.down_since = None
                log.info("instance %s is up", inst.url)
                if self.listener is not None:
                    await self.listener.health_changed(inst, True)
        else:
            inst.fails, inst.oks = inst.fails + 1, 0
            if inst.healthy and inst.fails >= self.failures:
                inst.healthy = False
                inst.down_since = asyncio.get_running_loop().time()
                log.warning("instance %s is down", inst.url)
                if self.listener is not None:
                    await self.listener.health_changed(inst, False)

    async def _read_waiting(self, inst: Instance) -> None:
        try:
            status, body = await self.fetch(inst, "/metrics")
        except (httpx.HTTPError, UpstreamError, OSError):
            return
        if status != 200:
            self.read_metrics = self.read_metrics and status != 404
            return
        if inst.spec.dp_rank is not None:  # a rank's own series: vLLM labels them engine="R"
            label = f'engine="{inst.spec.dp_rank}"'.encode()
            body = b"\n".join(line for line in body.split(b"\n") if label in line)
        m = _WAITING.search(body)
        if m:
            inst.engine_waiting = int(float(m.group(1)))
        info = _CACHE_INFO.search(body)
        found = [p.search(info.group(1)) for p in _BLOCK_SIZE] if info else []
        b = next((m for m in found if m), None)
        if b and int(b.group(1)) != inst.engine_block_size:
            inst.engine_block_size = int(b.group(1))
            if self.listener is not None:
                self.listener.block_size_seen(inst.url, inst.engine_block_size)
        inst.engine_stats = parse_engine_metrics(body)
