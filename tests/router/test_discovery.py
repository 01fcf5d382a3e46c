"""Zero-config instances: ``--instance URL`` alone, endpoints and data-parallel ranks read
from the instance's ``GET /kv_event_sources`` (vLLM 0.32's shape: ``{"rank": config}``).

An engine's HTTP face is a small loopback server answering what vLLM answers; its events
come from real ``events.publisher`` sockets, one per rank. Real vLLM is in
``tests/vllm/test_discovery.py``."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from routerkit import LoopbackHttp, batch, catch_up, eventually, free_port, stored

from events.publisher import ZmqEventPublisher
from router.config import RouterSettings
from router.fleet.discovery import DiscoveryError, resolve_sources, zmq_listening
from router.fleet.specs import parse_instance
from router.state import RouterState


def source(endpoint: str, replay: str | None = None, **extra: Any) -> dict[str, Any]:
    """One rank's entry as vLLM serializes its resolved ``KVEventsConfig``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "",
    } | extra


class VllmFace(LoopbackHttp):
    """``/kv_event_sources``, ``/health`` (503 while ``down``) and ``/v1/models`` over real
    HTTP on loopback; ``reads`` counts the reads of ``/kv_event_sources``."""

    def __init__(self, sources: dict[str, Any] | None) -> None:
        super().__init__()
        self.sources = sources  # None: the endpoint is absent (404), as before vLLM 0.32
        self.down = False
        self.reads = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                status, body = self._answer(path)
                writer.write(
                    b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d"
                    b"\r\n\r\n%s" % (status, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, path: str) -> tuple[int, bytes]:
        if self.down:
            return 503, b"{}"
        if path == "/kv_event_sources":
            self.reads += 1
            if self.sources is None:
                return 404, b'{"detail":"Not Found"}'
            return 200, json.dumps(self.sources).encode()
        if path == "/v1/models":
            return 200, b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
        return 200, b"{}"


def loopback() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_a_url_alone_asks_for_discovery_and_url_equals_nothing_does_not():
    assert parse_instance("http://h:8000").discover
    assert parse_instance("http://h:8000/").url == "http://h:8000"
    assert not parse_instance("http://h:8000=").discover
    assert not parse_instance("http://h:8000=tcp://h:5557").discover


async def test_wildcard_endpoints_are_reached_at_the_instance_host():
    specs = await resolve_sources(
        "http://10.0.0.7:8000", {0: source("tcp://*:5557", "tcp://*:5558", topic="kv")}
    )
    assert [(s.url, s.events, s.replay, s.topic, s.bind, s.dp_rank) for s in specs] == [
        ("http://10.0.0.7:8000", "tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv", False, None)
    ]
    v6 = await resolve_sources("http://[fd00::7]:8000", {0: source("tcp://[::]:5557")})
    assert v6[0].events == "tcp://[fd00::7]:5557"
    # vLLM binds a concrete IPv6 address ("::" in it): reached there, unprobed.
    bound6 = await resolve_sources("http://h:8000", {0: source("tcp://[fd00::9]:5557")})
    assert bound6[0].events == "tcp://[fd00::9]:5557"
    # A replay ROUTER on 0.0.0.0 listens everywhere; an events endpoint there is one vLLM
    # connects to (neither "*" nor "::" in it).
    any4 = await resolve_sources(
        "http://10.0.0.7:8000", {0: source("tcp://*:5557", f"tcp://0.0.0.0:{free_port()}")}
    )
    assert any4[0].replay.startswith("tcp://10.0.0.7:")
    with pytest.raises(DiscoveryError, match="vLLM connects"):
        await resolve_sources("http://127.0.0.1:8000", {0: source(f"tcp://0.0.0.0:{free_port()}")})


async def test_every_data_parallel_rank_becomes_a_target_with_its_own_endpoints():
    sources = {
        0: source("tcp://*:5557", "tcp://*:6000"),
        1: source("tcp://*:5558", "tcp://*:6001"),
        2: {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "tcp://*:5559"},
    }
    specs = await resolve_sources("http://h:8000", sources)
    assert [(s.url, s.events, s.replay, s.dp_rank, s.dp_size) for s in specs] == [
        ("http://h:8000#dp0", "tcp://h:5557", "tcp://h:6000", 0, 3),
        ("http://h:8000#dp1", "tcp://h:5558", "tcp://h:6001", 1, 3),
        ("http://h:8000#dp2", None, None, 2, 3),  # publishes nothing: routed on load alone
    ]
    assert all(s.http_url == "http://h:8000" for s in specs)


async def test_an_endpoint_vllm_connects_to_is_refused_naming_the_flags_to_set():
    nothing_there = loopback()
    with pytest.raises(DiscoveryError) as err:
        await resolve_sources("http://127.0.0.1:8000", {0: source(nothing_there)})
    text = str(err.value)
    assert f"vLLM connects its KV event publisher to {nothing_there}" in text
    assert "--instance 'http://127.0.0.1:8000=" in text and "--kv-events-config" in text
    with pytest.raises(DiscoveryError, match="inside vLLM's process"):
        await resolve_sources("http://h:8000", {0: source("inproc://kv")})


async def test_a_concrete_endpoint_vllm_bound_is_used_as_given():
    """``tcp://*:0`` comes back as the node's IP and the port the OS picked: a ZMQ socket
    answers there, so vLLM bound it."""
    pub = ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", bind=True)
    try:
        assert await zmq_listening(pub.endpoint)
        specs = await resolve_sources("http://127.0.0.1:8000", {0: source(pub.endpoint)})
        assert specs[0].events == pub.endpoint
    finally:
        pub.shutdown()
    assert not await zmq_listening(loopback())


async def test_router_follows_every_rank_from_the_url_alone_and_rereads_after_a_restart():
    pubs = [
        ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", bind=True, replay_endpoint=loopback())
        for _ in range(2)
    ]
    face = VllmFace({str(r): source(p.endpoint, p.replay_endpoint) for r, p in enumerate(pubs)})
    async with face:
        state = RouterState(
            RouterSettings(
                instances=[face.url], health_interval_s=0.1, health_failures=1, engine_metrics=False
            )
        )
        await state.start()
        try:
            ranks = [f"{face.url}#dp0", f"{face.url}#dp1"]
            assert [i.url for i in state.registry.all()] == ranks
            assert [i.route_headers for i in state.registry.all()] == [
                {"x-data-parallel-rank": "0"},
                {"x-data-parallel-rank": "1"},
            ]
            for r, pub in enumerate(pubs):
                pub.publish(batch(stored([10 + r]), ts=time.time()))
            for r, pub in enumerate(pubs):
                await catch_up(state.ingest, ranks[r], pub, 0)
            assert await state.index.lookup([10, 11]) == {ranks[0]: {0: 0b01}, ranks[1]: {0: 0b10}}
            # vLLM restarts on other ports with one rank: the router reads its sources again.
            new = ZmqEventPublisher(
                endpoint="tcp://127.0.0.1:0", bind=True, replay_endpoint=loopback()
            )
            pubs.append(new)
            face.down = True
            await eventually(lambda: _down(state))
            face.sources = {"0": source(new.endpoint, new.replay_endpoint)}
            face.down = False
            await eventually(lambda: _targets(state, [face.url]))
            (inst,) = state.registry.all()
            assert (inst.spec.events, inst.spec.replay) == (new.endpoint, new.replay_endpoint)
            new.publish(batch(stored([12]), ts=time.time()))
            await catch_up(state.ingest, face.url, new, 0)
            assert await state.index.lookup([10, 11, 12]) == {face.url: {0: 0b100}}
        finally:
            await state.stop()
            for pub in pubs:
                pub.shutdown()


async def test_a_server_without_the_endpoint_is_routed_on_load_and_a_down_one_is_read_later():
    async with VllmFace(None) as old, VllmFace({"0": source(loopback())}) as late:
        late.down = True
        late_pub = ZmqEventPublisher(endpoint="tcp://127.0.0.1:0", bind=True)
        late.sources = {"0": source(late_pub.endpoint)}
        state = RouterState(
            RouterSettings(
                instances=[old.url, late.url],
                health_interval_s=0.1,
                health_failures=1,
                engine_metrics=False,
            )
        )
        await state.start()
        try:
            assert state.registry.get(old.url).spec.events is None
            assert old.reads == 1
            assert state.registry.get(late.url).spec.events is None  # not readable yet
            late.down = False
            await eventually(lambda: _events_of(state, late.url, late_pub.endpoint))
            assert old.reads == 1  # read once: no re-reads while it stays up
        finally:
            await state.stop()
            late_pub.shutdown()


async def test_the_router_refuses_to_start_on_an_endpoint_vllm_connects_to():
    async with VllmFace({"0": source(loopback())}) as face:
        state = RouterState(RouterSettings(instances=[face.url], engine_metrics=False))
        with pytest.raises(DiscoveryError, match="vLLM connects its KV event publisher"):
            await state.start()
        await state.stop()


async def _down(state: RouterState) -> bool:
    return not any(i.healthy for i in state.registry.all())


async def _targets(state: RouterState, urls: list[str]) -> bool:
    return [i.url for i in state.registry.all()] == urls and all(
        i.healthy for i in state.registry.all()
    )


async def _events_of(state: RouterState, url: str, endpoint: str) -> bool:
    inst = state.registry.get(url)
    return inst is not None and inst.spec.events == endpoint
