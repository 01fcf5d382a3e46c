"""Admin token (constant-time compare), forwarding only to registered instances, loopback
binds by default, Redis authentication and TLS from the index URL."""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
import uuid

import httpx
import pytest
import redis
import redis.asyncio.connection as rconn

import router.http.app
from engine_adapter.sim.settings import EngineSettings
from events.structs import BlockStored, KVEventBatch
from router.config import RouterSettings
from router.http.app import create_app
from router.index import open_index
from router.index.redis_index import RedisIndex
from router.state import RouterState
from stack.chaos import free_port
from stack.procs import private_redis

TOKEN = "s3cret-admin-token"


async def _admin_answers(settings: RouterSettings, auth: str | None) -> list[int]:
    state = RouterState(settings)
    app = create_app(state)
    headers = {} if auth is None else {"authorization": auth.encode("latin-1")}
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router"
        ) as c:
            return [
                (await c.get("/admin/instances", headers=headers)).status_code,
                (
                    await c.post("/admin/instances", json={"instance": "x"}, headers=headers)
                ).status_code,
                (await c.delete("/admin/instances?url=http://a:1", headers=headers)).status_code,
            ]
    finally:
        await state.client.aclose()
        await state.index.close()


async def test_admin_api_requires_the_token_compared_in_constant_time(monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(router.http.app.hmac, "compare_digest", spy)
    settings = RouterSettings(admin_token=TOKEN)
    wrong = (
        None,
        "",
        "Bearer",
        f"Basic {TOKEN}",
        TOKEN,
        f"Bearer {TOKEN[:-1]}",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN.upper()}",
        "Bearer \u00e9t\u00e9",
    )
    right = (f"Bearer {TOKEN}", f"bearer  {TOKEN} ")
    for auth in wrong:
        assert await _admin_answers(settings, auth) == [401, 401, 401], auth
    # Authorized: listed; a bad instance spec is a 400, an unknown one a 404 -- past auth.
    for auth in right:
        assert await _admin_answers(settings, auth) == [200, 400, 404], auth
    # Every bearer token went through hmac.compare_digest, as bytes against the token.
    bearer = [a for a in (*wrong, *right) if a and a.lower().startswith("bearer")]
    assert len(compared) == 3 * len(bearer)
    assert all(b == TOKEN.encode() and isinstance(a, bytes) for a, b in compared)
    # No token configured: the admin API does not exist.
    assert await _admin_answers(RouterSettings(), f"Bearer {TOKEN}") == [404, 404, 404]


class Trap:
    """A loopback listener that counts connections: nothing may ever reach it."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Trap:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self._server = await asyncio.start_server(accept, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


async def test_router_only_forwards_to_registered_instances(edge):
    router, engine = edge.router, edge.engine
    async with Trap() as trap:
        bodies = [
            {"prompt": "where to?", "max_tokens": 1, key: trap.url}
            for key in ("url", "base_url", "api_base", "instance", "endpoint", "host", "model")
        ]
        bodies.append({"prompt": "x", "max_tokens": 1, "model": f"{trap.url}/v1/completions"})
        headers = [
            {"host": f"127.0.0.1:{trap.port}"},
            {"x-forwarded-host": f"127.0.0.1:{trap.port}", "x-forwarded-proto": "http"},
            {"forwarded": f"host=127.0.0.1:{trap.port};proto=http"},
            {"x-kvroute-instance": trap.url},
            {"x-original-url": f"{trap.url}/v1/completions", "x-rewrite-url": trap.url},
        ]
        answers = []
        async with httpx.AsyncClient(timeout=30) as c:
            for body in bodies:
                answers.append(await c.post(f"{router.url}/v1/completions", json=body))
            for h in headers:
                body = {"prompt": "where to?", "max_tokens": 1}
                answers.append(await c.post(f"{router.url}/v1/completions", json=body, headers=h))
            answers.append(
                await c.post(f"{router.url}/debug/route", json={"prompt": "x", "url": trap.url})
            )
            # Adding an instance needs the token.
            spec = {"instance": trap.url}
            assert (await c.post(f"{router.url}/admin/instances", json=spec)).status_code == 401
            listed = await c.get(
                f"{router.url}/admin/instances", headers={"authorization": f"Bearer {edge.token}"}
            )
            assert [i["url"] for i in listed.json()["instances"]] == [engine.url]
        # An absolute-form request target naming the trap.
        raw = await asyncio.to_thread(_absolute_form, router.port, trap)
        await asyncio.sleep(0.2)
    assert trap.connections == 0
    forwarded = [a for a in answers if "x-kvroute-instance" in a.headers]
    # The two bodies naming the trap as their "model" name no served model: the router
    # answers vLLM's 404 itself (router.fleet.models) and forwards nothing.
    refused = [a for a in answers[: len(bodies)] if a.status_code == 404]
    assert len(refused) == 2 and all("does not exist" in a.text for a in refused)
    assert len(forwarded) == len(bodies) + len(headers) - 2
    assert {a.headers["x-kvroute-instance"] for a in forwarded} == {engine.url}
    assert raw.startswith(b"HTTP/1.1 ")


def _absolute_form(port: int, trap: Trap) -> bytes:
    body = b'{"prompt": "absolute", "max_tokens": 1}'
    req = (
        f"POST {trap.url}/v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{trap.port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _listeners(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as fh:
            next(fh)
            for line in fh:
                local, state = line.split()[1], line.split()[3]
                addr, _, p = local.partition(":")
                if state == "0A" and int(p, 16) == port:
                    found.add(_addr(addr, width))
    return found


def _addr(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def test_default_binds_are_loopback(edge):
    assert RouterSettings().host == "127.0.0.1"
    assert EngineSettings().host == "127.0.0.1"
    # The processes were started without --host: they listen on loopback only.
    for proc in (edge.router, edge.engine):
        assert _listeners(proc.port) == {"127.0.0.1"}, proc.name
    replay_port = int(edge.engine.replay.rsplit(":", 1)[1])
    assert _listeners(replay_port) == {"127.0.0.1"}


def test_redis_tls_and_auth_options_come_from_the_index_url():
    url = "rediss://:pw@127.0.0.1:6390/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
    assert RouterSettings(index=url).index == url
    idx = open_index(url, model="m", hash_algo="sha256_cbor", hash_seed=None)
    pool = idx.redis.connection_pool
    assert issubclass(pool.connection_class, rconn.SSLConnection)
    assert pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["ssl_cert_reqs"] == "required"
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    unix = open_index("unix:///run/redis/redis.sock?db=2&password=pw")
    upool = unix.redis.connection_pool
    assert issubclass(upool.connection_class, rconn.UnixDomainSocketConnection)
    assert upool.connection_kwargs["path"] == "/run/redis/redis.sock"
    assert upool.connection_kwargs["password"] == "pw"


@pytest.fixture
def redis_with_password():
    password = uuid.uuid4().hex
    with private_redis(password=password) as server:
        yield server.port, password


async def test_redis_index_authenticates_with_the_password_in_the_url(redis_with_password):
    port, password = redis_with_password
    batch = KVEventBatch(ts=time.time(), events=[BlockStored([7], None, [], 16, None, "GPU", None)])
    ns = f"kvr:{{t{uuid.uuid4().hex[:8]}}}"
    good = RedisIndex(f"redis://:{password}@127.0.0.1:{port}/0", namespace=ns)
    try:
        await good.apply("e", batch, seq=0)
        assert await good.lookup([7]) == {"e": {0: 1}}
    finally:
        await good.close()
    for url in (f"redis://127.0.0.1:{port}/0", f"redis://:wrong@127.0.0.1:{port}/0"):
        bad = RedisIndex(url, namespace=ns)
        try:
            with pytest.raises(redis.exceptions.RedisError):  # NOAUTH / WRONGPASS
                await bad.lookup([7])
        finally:
            await bad.close()
