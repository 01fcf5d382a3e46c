"""Zero-config instances: an instance named by its URL alone tells the router where its
KV events are.

vLLM 0.32+ serves ``GET /kv_event_sources``: ``{rank: KVEventsConfig}`` for every ready
data-parallel engine, each with the endpoints its publisher resolved (the DP port offset
applied, a ``tcp://*:0`` bound to the node's IP and the port the OS picked). From it:

* an endpoint vLLM binds on a wildcard (``tcp://*:P``, ``[::]``) is reached at the
  instance's host; ipc endpoints as they are (same host);
* a concrete ``tcp://HOST:P`` is either where vLLM bound a ``tcp://*:0`` or where it
  *connects* (a collector must bind there). A ZMQ socket answering there with ZMTP's
  greeting is vLLM's; nothing listening means vLLM connects, and the router refuses it
  with a message naming the flag that would work (it cannot bind an address it was not
  told to own); the replay endpoint is always bound by vLLM;
* ``inproc`` endpoints live inside vLLM's process and are refused.

One rank stays the instance itself; several become one target per rank (``URL#dpR``,
reached with vLLM's ``X-data-parallel-rank``), as ``--instance URL=...,dp=N`` would. The
models and the block size come from the probes every instance gets (``/v1/models``,
``/metrics``' ``vllm:cache_config_info``). A server without the endpoint (older vLLM, the
simulated engine: 404) is routed on load alone, as an instance given without events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlparse

import httpx

from router.fleet.specs import InstanceSpec

__all__ = ["Discovery", "DiscoveryError", "read_event_sources", "resolve_sources", "zmq_listening"]

log = logging.getLogger(__name__)

_WILDCARDS = ("*", "[::]", "::", "0.0.0.0")


class DiscoveryError(ValueError):
    """The instance's event sources cannot be followed from its URL alone; says why and
    which flag to set instead."""


async def read_event_sources(
    client: httpx.AsyncClient, url: str, timeout: float
) -> dict[int, dict[str, Any]] | None:
    """``GET {url}/kv_event_sources`` as ``{rank: config}``; None when the server has no
    such endpoint (404/405: older vLLM, another engine). Raises ``httpx.HTTPError`` when
    the instance does not answer, ``DiscoveryError`` when the answer is malformed."""
    r = await client.get(f"{url}/kv_event_sources", timeout=timeout)
    if r.status_code in (404, 405):
        return None
    if r.status_code != 200:
        raise httpx.HTTPStatusError(
            f"{url}/kv_event_sources answered {r.status_code}", request=r.request, response=r
        )
    try:
        body = r.json()
        if not isinstance(body, dict):
            raise TypeError("not an object")
        out = {int(rank): cfg for rank, cfg in body.items()}
    except (ValueError, TypeError) as exc:
        raise DiscoveryError(f"{url}/kv_event_sources: malformed answer ({exc})") from None
    for rank, cfg in out.items():
        if rank < 0 or not isinstance(cfg, dict):
            raise DiscoveryError(f"{url}/kv_event_sources: bad entry for rank {rank}")
    return out


async def zmq_listening(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether a ZMQ socket listens at a ``tcp://HOST:PORT`` endpoint: it accepts the TCP
    connection and sends ZMTP's signature (``0xff``, 8 bytes, ``0x7f``) unprompted. The
    connection is closed before any handshake, so the peer never sees a subscriber."""
    host, port = _host_port(endpoint)
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            sig = await reader.readexactly(10)
        return sig[0] == 0xFF and sig[9] == 0x7F
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _host_port(endpoint: str) -> tuple[str, int]:
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


def _at_host(endpoint: str, host: str) -> str:
    """A wildcard-bound tcp endpoint as reached at the instance's host."""
    bound, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    if bound not in _WILDCARDS:
        return endpoint
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


async def _reachable(
    url: str, rank: int, key: str, endpoint: str, host: str, *, always_bound: bool
) -> str:
    """Where the router reaches one of vLLM's endpoints, or ``DiscoveryError``."""
    if endpoint.startswith("ipc://"):
        return endpoint
    if endpoint.startswith("inproc://"):
        raise DiscoveryError(
            f"{url} rank {rank}: {key} {endpoint} lives inside vLLM's process; start vLLM "
            f"with a tcp:// or ipc:// {key} in --kv-events-config"
        )
    if not endpoint.startswith("tcp://"):
        raise DiscoveryError(f"{url} rank {rank}: unsupported {key} {endpoint!r}")
    bound, _ = endpoint.removeprefix("tcp://").rsplit(":", 1)
    # vLLM binds what holds "*" or "::" (its rule); a bound 0.0.0.0 too listens everywhere,
    # but an events endpoint on 0.0.0.0 holds neither: vLLM connects there.
    if bound in ("*", "[::]", "::") or (always_bound and bound == "0.0.0.0"):
        return _at_host(endpoint, host)
    if "::" in bound or always_bound or await zmq_listening(endpoint):
        return endpoint  # bound there by vLLM (a tcp://*:0 it resolved, or a replay ROUTER)
    raise DiscoveryError(
        f"{url} rank {rank}: vLLM connects its KV event publisher to {endpoint} (it binds "
        "only tcp://*, [::], ipc and inproc endpoints), so a collector must bind there and "
        "the router cannot find that out by itself. Either start vLLM with --kv-events-config "
        '\'{"endpoint": "tcp://*:PORT", ...}\' or give the router the endpoint to bind: '
        f"--instance '{url}=<that --kv-events-config JSON>'"
    )


async def resolve_sources(url: str, sources: dict[int, dict[str, Any]]) -> list[InstanceSpec]:
    """The targets for an instance's ``/kv_event_sources``: one spec for a single rank
    (named ``url``), one per rank (``url#dpR``) for several; ``[InstanceSpec(url)]`` when
    no rank publishes. Raises ``DiscoveryError`` for an endpoint the router cannot reach."""
    host = urlparse(url).hostname or "127.0.0.1"
    several = len(sources) > 1
    specs = []
    for rank, cfg in sorted(sources.items()):
        name = f"{url}#dp{rank}" if several else url
        dp_size, dp_rank = (len(sources), rank) if several else (1, None)
        if not cfg.get("enable_kv_cache_events") or cfg.get("publisher") == "null":
            specs.append(InstanceSpec(name, dp_size=dp_size, dp_rank=dp_rank))  # load alone
            continue
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise DiscoveryError(f"{url} rank {rank}: no endpoint in /kv_event_sources")
        events = await _reachable(url, rank, "endpoint", endpoint, host, always_bound=False)
        replay = cfg.get("replay_endpoint")
        if replay is not None:
            replay = await _reachable(
                url, rank, "replay_endpoint", str(replay), host, always_bound=True
            )
        topic = str(cfg.get("topic") or "")
        specs.append(
            InstanceSpec(name, events, replay, topic, bind=False, dp_size=dp_size, dp_rank=dp_rank)
        )
    return specs or [InstanceSpec(url)]


class Discovery:
    """The instances named by URL alone: reads their sources when added, again at each
    probe until it succeeds, and whenever an instance comes back up (a restarted vLLM may
    publish elsewhere: a ``tcp://*:0`` port, a changed rank count); targets change only
    when the sources did.

    ``add_target`` / ``remove_target`` register and drop one target (its ingest, models,
    health), as the router does for instances given with their endpoints.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        timeout_s: float,
        add_target: Callable[[InstanceSpec], Awaitable[Any]],
        remove_target: Callable[[str], Awaitable[None]],
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self._add, self._remove = add_target, remove_target
        self.targets: dict[str, tuple[InstanceSpec, ...]] = {}  # URL -> its targets now
        self.pending: set[str] = set()  # URLs not read yet (down when added)
        self._busy: set[str] = set()

    def __contains__(self, url: str) -> bool:
        return url in self.targets

    async def add(self, spec: InstanceSpec) -> list[InstanceSpec]:
        """Register an instance given by URL alone; ``DiscoveryError`` (a ValueError) when
        its sources cannot be followed. An instance that does not answer yet is
        registered on load alone and read again once it is up."""
        url = spec.url
        try:
            specs = await self._read(url)
        except httpx.HTTPError as exc:
            log.warning("%s: /kv_event_sources not readable yet (%s); retried when up", url, exc)
            specs = [InstanceSpec(url, models=spec.models)]
            self.pending.add(url)
        specs = [replace(s, models=spec.models) for s in specs]
        for s in specs:
            await self._add(s)
        self.targets[url] = tuple(specs)
        return specs

    def forget(self, url: str) -> None:
        self.targets.pop(url, None)
        self.pending.discard(url)

    async def refresh(self, url: str) -> bool:
        """Read ``url``'s sources again; re-register its targets if they changed. True
        when they did. Errors are logged: the instance keeps its current targets."""
        if url not in self.targets or url in self._busy:
            return False
        self._busy.add(url)
        try:
            return await self._refresh(url)
        finally:
            self._busy.discard(url)

    async def _refresh(self, url: str) -> bool:
        try:
            specs = await self._read(url)
        except (httpx.HTTPError, DiscoveryError) as exc:
            log.warning("%s: cannot re-read /kv_event_sources: %s", url, exc)
            return False
        self.pending.discard(url)
        old = self.targets.get(url, ())
        models = old[0].models if old else ()
        new = tuple(replace(s, models=models) for s in specs)
        if new == old or url not in self.targets:
            return False
        log.info("%s: event sources now %s", url, [(s.url, s.events, s.replay) for s in new])
        for s in old:
            await self._remove(s.url)
        for s in new:
            await self._add(s)
        self.targets[url] = new
        return True

    async def _read(self, url: str) -> list[InstanceSpec]:
        sources = await read_event_sources(self.client, url, self.timeout_s)
        if sources is None:
            log.info("%s serves no /kv_event_sources: routed on load alone", url)
            return [InstanceSpec(url)]
        return await resolve_sources(url, sources)
