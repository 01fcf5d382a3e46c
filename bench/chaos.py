"""``kvroute bench chaos``: inject faults into a live deployment and count what they cost.

Every scenario runs real processes on loopback (engines, a router, Redis) or the real
in-process event path, injects one kind of fault and returns a row of figures plus the
raw observations the reliability tests (``tests/reliability``) assert on:

* ``engine_kill``: SIGKILL an engine while streams run through the router. Requests that
  had no first byte must be retried elsewhere (0 lost); streams already started must end
  with an SSE error chunk; the dead engine's residency must be dropped and, once it is back
  (sequence from 0), rebuilt from its new events only.
* ``dropped_events``: a ZMQ proxy between an engine's publisher and the router's ingest
  drops a window of batches; the subscriber must detect the gap and replay it (index ==
  the engine's true residency), or -- when the replay buffer lost them -- clear and rebuild
  the instance (index a subset of the truth: never stale).
* ``redis_outage``: kill Redis under load, restart it empty: 0 failed requests, routing
  on load only meanwhile, then cache-aware again with the history rebuilt from replay.
* ``fuzz_events`` / ``fuzz_http``: random and mutated msgpack payloads through the real
  subscriber and ingest; random and mutated HTTP bodies and headers into router and engine.
* ``stream_load``: many concurrent streams through the router, each stream's text checked
  against the engine's deterministic filler; the router's RSS before and after.

``run(out, ...)`` runs them all, prints the table and writes ``out/chaos.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_report

__all__ = [
    "Fleet",
    "StreamOutcome",
    "dropped_events",
    "engine_kill",
    "expected_text",
    "fuzz_events",
    "fuzz_http",
    "oversize_checks",
    "redis_outage",
    "rss_mb",
    "run",
    "scrape",
    "stream_load",
]

REPO = Path(__file__).resolve().parent.parent
KVROUTE = [sys.executable, "-m", "kvroute_cli.main"]
LOOPBACK = "127.0.0.1"

# ---- processes --------------------------------------------------------------------------

_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nobody listens on (and not handed out before by this process)."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port")


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was up")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


@dataclass
class Proc:
    """A child process on loopback: an engine, a router or a redis-server."""

    name: str
    cmd: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    health_path: str | None = "/health"
    # Engines: where they publish (ipc:// binds a socket file, reachable only locally).
    events: str | None = None
    replay: str | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def instance_arg(self) -> str:
        return f"{self.url}={self.events},replay={self.replay}"

    def launch(self) -> Proc:
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        return self

    def wait_ready(self, timeout: float = 60.0) -> Proc:
        assert self.proc is not None
        try:
            if self.health_path is not None:
                wait_http(self.url + self.health_path, timeout, self.proc)
            else:
                _wait_redis(self.port, timeout, self.proc)
        except Exception:
            self.kill()
            raise RuntimeError(f"{self.name} failed to start:\n{self.tail()}") from None
        return self

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye (sockets close as the process dies)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _wait_redis(port: int, timeout: float, proc: subprocess.Popen) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis(host=LOOPBACK, port=port, socket_timeout=1).ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.02)


class Fleet:
    """Starts engines / routers / Redis in a scratch directory; ``close`` stops them all."""

    def __init__(self, workdir: Path | None = None) -> None:
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvroute-chaos-"))
        self.sockets = Path(tempfile.mkdtemp(prefix="kvr-"))  # ipc paths: 107 bytes at most
        self.procs: list[Proc] = []

    def engine(self, *args: str, wait: bool = True, name: str | None = None) -> Proc:
        port, replay_port = free_port(), free_port()
        sock = self.sockets / f"ev-{port}"
        cfg = {
            "enable_kv_cache_events": True,
            "endpoint": f"ipc://{sock}",
            "replay_endpoint": f"tcp://{LOOPBACK}:{replay_port}",
        }
        cmd = [*KVROUTE, "--log-level", "WARNING", "engine", "--port", str(port)]
        cmd += ["--kv-events-config", json.dumps(cfg), "--log-level", "warning", *args]
        p = Proc(name or f"engine-{port}", cmd, port, self.dir / f"engine-{port}.log")
        p.events, p.replay = cfg["endpoint"], cfg["replay_endpoint"]
        self.procs.append(p.launch())
        return p.wait_ready() if wait else p

    def restart(self, p: Proc) -> Proc:
        """Start a killed process again with the same command line (same ports)."""
        assert not p.alive
        deadline = time.monotonic() + 10
        while not _port_free(p.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        return p.launch()

    def router(self, engines: list[Proc], *args: str, env: dict[str, str] | None = None) -> Proc:
        port = free_port()
        cmd = [*KVROUTE, "--log-level", "WARNING", "router", "--port", str(port)]
        cmd += ["--health-interval", "0.5", "--log-level", "warning"]
        for e in engines:
            cmd += ["--instance", e.instance_arg()]
        p = Proc(f"router-{port}", [*cmd, *args], port, self.dir / f"router-{port}.log", env or {})
        self.procs.append(p.launch())
        return p.wait_ready()

    def redis(self, port: int | None = None) -> Proc:
        port = port or free_port()
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        cmd = [exe, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no"]
        p = Proc(f"redis-{port}", cmd, port, self.dir / f"redis-{port}.log", health_path=None)
        self.procs.append(p.launch())
        return p.wait_ready(15)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        shutil.rmtree(self.sockets, ignore_errors=True)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def start_engines(fleet: Fleet, count: int, *args: str) -> list[Proc]:
    """Launch ``count`` engines at once (their imports overlap), then wait for all."""
    engines = [fleet.engine(*args, wait=False) for _ in range(count)]
    return [e.wait_ready() for e in engines]


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc (MB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


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


# ---- scenario: an engine is SIGKILLed mid-run, then comes back -------------------------


async def engine_kill(
    fleet: Fleet,
    *,
    requests: int = 40,
    spread_s: float = 3.0,
    max_tokens: int = 48,
    engine_args: tuple[str, ...] = ("--profile", "full", "--time-scale", "1"),
) -> dict[str, Any]:
    """Two engines behind a router; streams arrive over ``spread_s``; engine A is killed
    while some of its streams run and more requests are still to come; then A restarts
    on the same ports."""
    a, b = start_engines(fleet, 2, *engine_args, "--gpu-blocks", "2048")
    token = uuid.uuid4().hex
    router = fleet.router([a, b], env={"KVROUTE_ADMIN_TOKEN": token})
    admin = {"authorization": f"Bearer {token}"}
    old_prompt = f"residency of the first incarnation {uuid.uuid4().hex} " * 6
    res: dict[str, Any] = {"fault": "engine SIGKILL mid-stream", "injected": 1}
    async with new_client(requests + 20) as client:
        # A holds prompts the router knows about (sent to A directly, not routed).
        for i in range(6):
            body = {"prompt": f"{i} {old_prompt}" if i else old_prompt, "max_tokens": 2}
            r = await client.post(f"{a.url}/v1/completions", json=body)
            r.raise_for_status()
        await wait_for(
            lambda: _holds(client, router.url, old_prompt, a.url),
            30,
            what="the router to ingest A's blocks",
        )
        res["old_last_seq"] = await _admin_last_seq(client, router.url, admin, a.url)

        async def one(i: int) -> StreamOutcome:
            await asyncio.sleep(spread_s * i / requests)
            prompt = f"request {i} of the kill run; " * (2 + i % 5)
            return await send_completion(
                client, router.url, i, prompt, max_tokens, stream=i % 4 != 3
            )

        t_start = time.monotonic()
        tasks = [asyncio.create_task(one(i)) for i in range(requests)]
        try:
            # Kill A once some of its streams are running, while later requests are pending.
            res["first_running_on_killed_s"] = await wait_for(
                lambda: _running_on(client, router.url, a.url),
                spread_s * 3,
                interval=0.02,
                what="streams running on A",
            )
            await asyncio.sleep(max(0.0, spread_s * 0.3 - (time.monotonic() - t_start)))
            await wait_for(
                lambda: _running_on(client, router.url, a.url),
                spread_s * 3,
                interval=0.02,
                what="streams running on A",
            )
            t_kill = time.monotonic()
            a.kill()
            res["kill_at_s"] = t_kill - t_start
            down_s = await wait_for(
                lambda: _healthy_is(client, router.url, a.url, 0.0),
                15,
                interval=0.05,
                what="A to be marked down",
            )
            outcomes = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        res["requests"] = len(outcomes)
        res["sent_after_kill"] = sum(1 for o in outcomes if o.started_at > t_kill)
        res["running_at_kill"] = sum(
            1 for o in outcomes if o.started_at < t_kill and o.ended_at > t_kill
        )
        res["broken_streams"] = [o.index for o in outcomes if o.failed_cleanly]
        res["broken_streams_not_from_killed"] = [
            o.index for o in outcomes if o.failed_cleanly and o.instance != a.url
        ]
        res["lost"] = [o.describe() for o in outcomes if o.lost]
        res["served_by"] = {
            u: sum(1 for o in outcomes if o.ok and o.instance == u) for u in (a.url, b.url)
        }
        res["detect_down_s"] = down_s
        metrics = await metrics_text(client, router.url)
        res["resyncs_after_kill"] = scrape(metrics, "kvroute_ingest_resyncs_total", instance=a.url)

        # A comes back on the same ports: a new incarnation, sequence from 0, empty cache.
        t_restart = time.monotonic()
        fleet.restart(a).wait_ready()
        res["restart_s"] = time.monotonic() - t_restart
        up_s = await wait_for(
            lambda: _healthy_is(client, router.url, a.url, 1.0),
            20,
            interval=0.05,
            what="A to be marked up again",
        )
        # Before A publishes anything, the router must credit it with nothing.
        view = await route_view(client, router.url, old_prompt)
        res["old_residency_after_restart"] = index_tokens(view, a.url)
        new_prompt = f"second incarnation {uuid.uuid4().hex} " * 6

        async def rebuilt() -> bool:
            r = await client.post(f"{a.url}/v1/completions", json={"prompt": new_prompt})
            r.raise_for_status()  # (repeats are cached: the new incarnation publishes once)
            return bool(await _holds(client, router.url, new_prompt, a.url))

        rebuild_s = await wait_for(rebuilt, 20, interval=0.3, what="A's new events")
        view = await route_view(client, router.url, old_prompt)
        res["old_residency_after_rebuild"] = index_tokens(view, a.url)
        res["new_last_seq"] = await _admin_last_seq(client, router.url, admin, a.url)
        res["recovery_s"] = time.monotonic() - t_restart
        res["up_after_restart_s"] = up_s
        res["rebuild_s"] = rebuild_s
    res["lost_count"] = len(res["lost"])
    return res


async def _holds(client: httpx.AsyncClient, router: str, prompt: str, instance: str) -> bool:
    return (index_tokens(await route_view(client, router, prompt), instance) or 0) > 0


async def _running_on(client: httpx.AsyncClient, router: str, instance: str) -> bool:
    text = await metrics_text(client, router)
    return scrape(text, "kvroute_router_running_requests", instance=instance) >= 1


async def _healthy_is(client: httpx.AsyncClient, router: str, instance: str, v: float) -> bool:
    text = await metrics_text(client, router)
    return scrape(text, "kvroute_router_instance_healthy", instance=instance) == v


async def _admin_last_seq(
    client: httpx.AsyncClient, router: str, headers: dict[str, str], instance: str
) -> int | None:
    r = await client.get(f"{router}/admin/instances", headers=headers)
    r.raise_for_status()
    for inst in r.json()["instances"]:
        if inst["url"] == instance:
            return inst["last_seq"]
    return None


# ---- scenario: Redis dies under load and comes back empty ------------------------------


async def redis_outage(
    fleet: Fleet,
    *,
    downtime_s: float = 3.0,
    concurrency: int = 4,
    max_tokens: int = 4,
    engine_args: tuple[str, ...] = ("--profile", "swa-hybrid", "--time-scale", "20"),
) -> dict[str, Any]:
    """Two engines, a router on a Redis index, a steady load; Redis is SIGKILLed, stays
    down ``downtime_s`` (shorter than ingest's retry budget, so the feed never gives up on
    its own), and comes back empty. A prompt cached before the outage is never sent again:
    only a replay from seq 0 can bring its residency back."""
    redis = fleet.redis()
    engines = start_engines(fleet, 2, *engine_args, "--gpu-blocks", "4096")
    router = fleet.router(engines, "--index", f"redis://{LOOPBACK}:{redis.port}/0")
    probe = f"history that only a replay can restore {uuid.uuid4().hex} " * 6
    res: dict[str, Any] = {"fault": "Redis killed, restarted empty", "injected": 1}
    stop = asyncio.Event()
    outcomes: list[StreamOutcome] = []
    async with new_client(concurrency + 10) as client:
        r = await client.post(f"{router.url}/v1/completions", json={"prompt": probe})
        r.raise_for_status()
        holder = r.headers["x-kvroute-instance"]
        await wait_for(
            lambda: _holds(client, router.url, probe, holder), 30, what="the probe in Redis"
        )

        async def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = f"load {w}-{i} under a redis outage; " * (1 + i % 4)
                outcomes.append(
                    await send_completion(
                        client, router.url, len(outcomes), prompt, max_tokens, stream=i % 2 == 0
                    )
                )
                i += 1
                await asyncio.sleep(0)

        workers = [asyncio.create_task(worker(w)) for w in range(concurrency)]
        try:
            await asyncio.sleep(1.0)
            before = len(outcomes)
            redis.kill()
            t_kill = time.monotonic()
            fallback_seen = False
            while time.monotonic() - t_kill < downtime_s:
                view = await route_view(client, router.url, probe)
                fallback_seen = fallback_seen or view["index_ok"] is False
                await asyncio.sleep(0.2)
            during = len(outcomes) - before
            await asyncio.to_thread(lambda: fleet.restart(redis).wait_ready(15))
            t_up = time.monotonic()
            index_back_s = await wait_for(
                lambda: _index_ok(client, router.url, probe), 30, what="lookups to work again"
            )
            await wait_for(
                lambda: _holds(client, router.url, probe, holder), 30, what="the probe rebuilt"
            )
            recovery_s = time.monotonic() - t_up
            view = await route_view(client, router.url, probe)
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        metrics = await metrics_text(client, router.url)
    res["requests"] = len(outcomes)
    res["requests_during_outage"] = during
    res["lost"] = [o.describe() for o in outcomes if not o.ok]
    res["lost_count"] = len(res["lost"])
    res["fallback_seen"] = fallback_seen
    res["index_back_s"] = index_back_s
    res["recovery_s"] = recovery_s
    res["probe_holder"] = holder
    res["probe_view"] = {c["instance"]: c["index_score"] for c in view["candidates"]}
    res["index_errors"] = scrape(metrics, "kvroute_router_index_errors_total")
    res["resyncs"] = {
        e.url: scrape(metrics, "kvroute_ingest_resyncs_total", instance=e.url) for e in engines
    }
    return res


async def _index_ok(client: httpx.AsyncClient, router: str, prompt: str) -> bool:
    return bool((await route_view(client, router, prompt))["index_ok"])


# ---- scenario: many concurrent streams ------------------------------------------------


async def stream_load(
    fleet: Fleet,
    *,
    streams: int = 1000,
    rounds: int = 1,
    engines: int = 4,
    max_tokens: int = 8,
    engine_args: tuple[str, ...] = ("--profile", "full", "--time-scale", "50"),
    router_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``streams`` concurrent streaming completions through one router over ``engines``
    engines, ``rounds`` times; each stream's text must be what its engine's deterministic
    filler gives for its prompt, with one response id and one engine throughout."""
    procs = start_engines(fleet, engines, *engine_args, "--max-num-seqs", "512")
    router = fleet.router(procs, env=router_env)
    res: dict[str, Any] = {"fault": f"{streams} concurrent streams", "injected": 0}
    async with new_client(streams + 10, timeout=120) as client:
        warm = [
            send_completion(client, router.url, i, f"warm-up {i} " * (1 + i % 7), max_tokens)
            for i in range(40)
        ]
        warm_lost = [o.describe() for o in await asyncio.gather(*warm) if not o.ok]
        await asyncio.sleep(1.0)
        baseline = rss_mb(router.pid)
        lost: list[str] = []
        wall: list[float] = []
        after: list[float] = []
        ids: set[str] = set()
        total = 0
        peaks: list[float] = [baseline]

        async def sample(done: asyncio.Event) -> None:
            while not done.is_set():
                peaks.append(rss_mb(router.pid))
                await asyncio.sleep(0.1)

        for rnd in range(rounds):
            done = asyncio.Event()
            sampler = asyncio.create_task(sample(done))
            t0 = time.monotonic()
            outcomes = await asyncio.gather(
                *(
                    send_completion(
                        client,
                        router.url,
                        i,
                        f"round {rnd} stream {i}: " + "x" * (i % 97),
                        max_tokens,
                    )
                    for i in range(streams)
                )
            )
            wall.append(time.monotonic() - t0)
            done.set()
            await sampler
            total += len(outcomes)
            lost += [o.describe() for o in outcomes if not o.ok]
            for o in outcomes:
                ids |= o.ids
            await asyncio.sleep(2.0)  # settle: connections close, buffers go
            after.append(rss_mb(router.pid))
        metrics = await metrics_text(client, router.url)
    res["requests"] = total
    res["lost"] = lost
    res["lost_count"] = len(lost)
    res["warm_lost"] = warm_lost
    res["distinct_ids"] = len(ids)
    res["wall_s"] = wall
    res["rss_baseline_mb"] = baseline
    res["rss_peak_mb"] = max(peaks)
    res["rss_after_mb"] = after
    res["running_after"] = {
        p.url: scrape(metrics, "kvroute_router_running_requests", instance=p.url) for p in procs
    }
    res["inflight_after"] = {
        p.url: scrape(metrics, "kvroute_router_inflight_requests", instance=p.url) for p in procs
    }
    res["recovery_s"] = None
    return res


# ---- scenario: event batches dropped on the wire --------------------------------------


class DropProxy:
    """SUB from a publisher, PUB to the router side, dropping the batches whose seq is in
    ``drop`` -- a lossy network between an engine and a router. Binds both sides on
    loopback (the publisher connects, as vLLM's publishers do to a collector)."""

    def __init__(self, upstream: str, downstream: str) -> None:
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.bind(upstream)
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(downstream)
        self.drop: range = range(0)
        self.forwarded = 0
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            if len(frames) == 3 and int.from_bytes(frames[1], "big") in self.drop:
                self.dropped += 1
                continue
            await self.pub.send_multipart(frames)
            self.forwarded += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sub.close(0)
        self.pub.close(0)
        self.ctx.term()


class _EngineDriver:
    """An engine's KV cache (the real block pool, CPU tier included) on a random workload:
    shared prefixes, chunked prefills, decodes, evictions. Publishes each step's batch."""

    def __init__(self, profile: str, gpu_blocks: int, publisher: Any, seed: int) -> None:
        from engine_adapter.coordinator import KVCacheManager
        from engine_adapter.offload import OffloadConfig
        from engine_adapter.profiles import get_profile

        prof = get_profile(profile, sliding_window=64, page_bytes=32)
        offload = OffloadConfig(num_cpu_chunks=12, blocks_per_chunk=4)
        self.kv = KVCacheManager(prof, gpu_blocks, offload=offload, device="cpu")
        self.pub = publisher
        self.rng = random.Random(seed)
        self.prefixes = [
            [self.rng.randrange(50_000) for _ in range(self.rng.randrange(48, 200))]
            for _ in range(4)
        ]
        self.running: list[Any] = []
        self.published = 0  # == the publisher's next seq
        self.hashes: set[int] = set()  # every wire hash ever announced
        self.removals: list[int] = []  # BlockRemoved events per published batch (by seq)
        self._n = 0

    def publish(self, batch: Any) -> int:
        from events.structs import BlockRemoved, BlockStored

        for ev in batch.events:
            if type(ev) is BlockStored:
                self.hashes.update(ev.block_hashes)
        self.removals.append(sum(type(ev) is BlockRemoved for ev in batch.events))
        self.pub.publish(batch)
        self.published += 1
        return self.published - 1

    def filler(self) -> int:
        from events.structs import KVEventBatch

        return self.publish(KVEventBatch(ts=time.time(), events=[]))

    def step(self) -> int | None:
        """One engine step; the seq of its batch, or None when nothing changed."""
        rng, kv = self.rng, self.kv
        if len(self.running) < 3 and rng.random() < 0.7:
            base = rng.choice(self.prefixes) if rng.random() < 0.8 else []
            prompt = base + [rng.randrange(50_000) for _ in range(rng.randrange(1, 120))]
            req = kv.new_request(f"r{self._n}", prompt)
            self._n += 1
            gpu, cpu = kv.lookup(req)
            first = min(req.num_tokens - gpu - cpu, rng.choice([48, 96, 400])) or 1
            try:
                if kv.allocate_slots(req, first, gpu, cpu):
                    self.running.append(req)
            except LookupError:
                pass
        for req in list(self.running):
            left = req.num_tokens - req.num_computed_tokens
            if left > 0:
                ok = kv.allocate_slots(req, min(left, rng.choice([48, 96, 400])))
            elif rng.random() < 0.4:
                kv.free(req)
                self.running.remove(req)
                continue
            else:
                req.append_output_token_ids(rng.randrange(50_000))
                ok = kv.allocate_slots(req, 1)
            if not ok:  # out of blocks: preempt
                kv.free(req)
                self.running.remove(req)
        if rng.random() < 0.5:
            kv.flush()
        batch = kv.step_events()
        return None if batch is None else self.publish(batch)

    def finish(self) -> int:
        for req in self.running:
            self.kv.free(req)
        self.running.clear()
        self.kv.flush()
        batch = self.kv.step_events()
        return self.filler() if batch is None else self.publish(batch)

    def truth(self) -> set[tuple[int, int, int]]:
        """``(group, wire hash, tier)`` the engine holds (tier 0 GPU, 1 CPU)."""
        return {(g, h, 0 if m == "GPU" else 1) for (g, h, m), n in self.kv.residency().items() if n}


async def _index_entries(index: Any, name: str, hashes: set[int]) -> set[tuple[int, int, int]]:
    from router.index import NUM_TIERS

    order = sorted(hashes)
    found = (await index.lookup(order, [name])).get(name, {})
    out = set()
    for slot, mask in found.items():
        g, tier = divmod(slot, NUM_TIERS)
        out |= {(g, order[i], tier) for i in range(len(order)) if mask >> i & 1}
    return out


async def _caught_up(mgr: Any, name: str, engine: _EngineDriver, seq: int, timeout: float) -> None:
    """Wait until ``seq`` is applied; a batch lost to ZMQ's slow joiner is healed by
    replay once a later one arrives, so publish empty fillers while waiting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await mgr.wait_for_seq(name, seq, timeout=0.3)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
            seq = engine.filler()


async def dropped_events(
    *,
    drop: int = 20,
    buffer_steps: int = 10_000,
    steps: int = 150,
    seed: int = 0,
    profile: str = "swa-hybrid",
    gpu_blocks: int = 80,
) -> dict[str, Any]:
    """One engine's events through a lossy proxy into ``IngestManager`` + ``MemoryIndex``;
    ``drop`` consecutive batches vanish mid-run. With ``buffer_steps`` larger than what
    follows, replay heals the gap; smaller, the instance must be cleared and rebuilt."""
    from prometheus_client import CollectorRegistry

    from events.publisher import ZmqEventPublisher
    from router.index import MemoryIndex
    from router.ingest import IngestManager

    up, down, rep = free_port(), free_port(), free_port()
    proxy = DropProxy(f"tcp://{LOOPBACK}:{up}", f"tcp://{LOOPBACK}:{down}")
    proxy.start()
    pub = ZmqEventPublisher(
        endpoint=f"tcp://{LOOPBACK}:{up}",
        replay_endpoint=f"tcp://{LOOPBACK}:{rep}",
        buffer_steps=buffer_steps,
    )
    engine = _EngineDriver(profile, gpu_blocks, pub, seed)
    index, reg = MemoryIndex(), CollectorRegistry()
    mgr = IngestManager(index, registry=reg, replay_timeout=2.0)
    name = "engine"
    res: dict[str, Any] = {
        "fault": "event batches dropped"
        + (" (replayable)" if buffer_steps > steps else " (beyond replay buffer)"),
        "buffer_steps": buffer_steps,
    }
    try:
        await mgr.add_instance(
            name, f"tcp://{LOOPBACK}:{down}", f"tcp://{LOOPBACK}:{rep}", start_seq=0
        )
        await _caught_up(mgr, name, engine, engine.filler(), 30)
        for _ in range(steps // 3):
            engine.step()
        await _caught_up(mgr, name, engine, engine.filler(), 30)
        first = engine.published
        proxy.drop = range(first, first + drop)
        for _ in range(steps * 10):
            if engine.published >= first + drop:
                break
            engine.step()
        res["dropped_removals"] = sum(engine.removals[first : first + drop])
        # The next batch through reveals the gap: time until it (and the gap) is applied.
        t0 = time.monotonic()
        seq = engine.filler()
        await _caught_up(mgr, name, engine, seq, 30)
        res["recovery_s"] = time.monotonic() - t0
        # Right after the gap is handled: never stale (lost history may be missing).
        truth, got = engine.truth(), await _index_entries(index, name, engine.hashes)
        res["stale_after_gap"] = len(got - truth)
        res["missing_after_gap"] = len(truth - got)
        for _ in range(steps - steps // 3):
            engine.step()
        await _caught_up(mgr, name, engine, engine.finish(), 30)
        truth = engine.truth()
        got = await _index_entries(index, name, engine.hashes)
        res["injected"] = proxy.dropped
        res["batches"] = engine.published
        res["truth_entries"] = len(truth)
        res["index_entries"] = len(got)
        res["stale"] = len(got - truth)  # held by the index, not by the engine: must be 0
        res["missing"] = len(truth - got)  # under-prediction (lost history)
        res["exact"] = got == truth

        def m(metric: str) -> float:
            return reg.get_sample_value(metric, {"instance": name}) or 0.0

        res["gaps"] = m("kvroute_ingest_gaps_total")
        res["missed_batches"] = m("kvroute_ingest_missed_batches_total")
        res["replayed_batches"] = m("kvroute_ingest_replayed_batches_total")
        res["resyncs"] = m("kvroute_ingest_resyncs_total")
        res["lost_count"] = res["stale"] + res["stale_after_gap"]
    finally:
        await mgr.close()
        pub.shutdown()
        await proxy.close()
        engine.kv.close()
    return res


# ---- scenario: garbage on the event wire ----------------------------------------------


_INSANE_INTS = [-1, -(2**63), 2**31, 10**12, 2**63 - 1, 2**64 - 1]
_INSANE_TS = [float("nan"), float("inf"), -float("inf"), 1e300, -1.0, 0.0, 4e9]


def _valid_batch_objects(rng: random.Random, insane: bool = False) -> Any:
    """A well-formed batch; ``insane``: well-typed but absurd values (timestamps far in
    the future or NaN, negative or huge group indexes and block sizes, odd media)."""
    from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    def odd(normal: list[Any], extra: list[Any]) -> Any:
        return rng.choice(extra) if insane and rng.random() < 0.3 else rng.choice(normal)

    events: list[Any] = []
    for _ in range(rng.randrange(0, 5)):
        r = rng.random()
        hashes = [rng.randrange(1 << 64) for _ in range(rng.randrange(0, 6))]
        group = odd([None, 0, 1, 2], _INSANE_INTS)
        medium = odd([None, "GPU", "CPU", "STORAGE"], ["", "gpu", "\x00", "DISK" * 50])
        if r < 0.6:
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=rng.choice([None, rng.randrange(1 << 64)]),
                    token_ids=[rng.randrange(1000) for _ in range(rng.choice([0, 16]))],
                    block_size=odd([0, 16, 32], [*_INSANE_INTS, 3]),
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=group,
                    kv_cache_spec_kind=odd(
                        [None, "full_attention", "sliding_window", "mamba"], ["", "attention?"]
                    ),
                    kv_cache_spec_sliding_window=odd([None, 64], [0, *_INSANE_INTS]),
                )
            )
        elif r < 0.95:
            events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
        else:
            events.append(AllBlocksCleared())
    ts = odd([time.time()], _INSANE_TS)
    return KVEventBatch(ts=ts, events=events, data_parallel_rank=rng.choice([None, 0]))


_ODD = [None, True, False, 0, -1, 1, 16, 2**63, 2**64 - 1, -(2**63), 10**12, 1.5, -0.0]
_ODD += [float("nan"), float("inf"), 1e300, "", "GPU", "CPU", "BlockStored", "BlockRemoved"]
_ODD += ["AllBlocksCleared", "sliding_window", "mamba", "full_attention", b"", b"\x00" * 8]
_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
_FIELDS += ["medium", "lora_name", "group_idx", "kv_cache_spec_kind"]
_FIELDS += ["kv_cache_spec_sliding_window", "extra_keys", "session_id"]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.55:
        return rng.choice(_ODD) if rng.random() < 0.7 else rng.randrange(-(2**63), 2**64)
    if r < 0.8:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    keys = [*_FIELDS, 1, "x"]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(6))}


def _near_valid(rng: random.Random) -> Any:
    """Batch-shaped structures with the wrong types in random places."""
    events: list[Any] = []
    for _ in range(rng.randrange(5)):
        kind = rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", _random_value(rng)])
        values = [
            _random_value(rng, 2) if rng.random() < 0.4 else rng.choice(_ODD)
            for _ in range(rng.randrange(15))
        ]
        if rng.random() < 0.5:
            events.append({"type": kind, **dict(zip(_FIELDS[1:], values, strict=False))})
        else:
            events.append([kind, *values])
    batch = [rng.choice([time.time(), 0, -1.0, 1e300, float("nan"), "ts"]), events]
    if rng.random() < 0.7:
        batch.append(rng.choice([None, 0, 3, "rank", 2**64 - 1]))
    return batch


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        op = rng.randrange(6)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip bits
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:  # truncate
            del b[pos:]
        elif op == 2:  # insert random bytes
            b[pos:pos] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and b:  # delete a slice
            del b[pos : pos + rng.randrange(1, 9)]
        elif op == 4:  # a msgpack marker that lies about what follows
            b[pos:pos] = bytes([rng.choice([0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xDB, 0xC6, 0xCB])])
            b[pos + 1 : pos + 1] = rng.randbytes(4)
        else:  # duplicate a slice
            b[pos:pos] = b[pos : pos + rng.randrange(1, 17)]
    return bytes(b)


def random_payloads(n: int, seed: int = 0) -> list[bytes]:
    """``n`` payloads: mutated valid batches (map and array forms), random msgpack values,
    batch-shaped structures with wrong types, raw bytes and a few hostile classics."""
    import msgspec

    from events.codec import encode_batch

    rng = random.Random(seed)
    out: list[bytes] = [
        b"",
        b"\xc1",
        b"\x91" * 100_000 + b"\xc0",  # nesting deeper than any decoder's stack
        b"\xdd\xff\xff\xff\xff",  # an array header promising 4 billion items
        b"\xdb\xff\xff\xff\xff",  # a str header promising 4 GiB
        b"\x93\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00\x90\xc0",  # ts = +inf
        b"\x93\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00\x90\xc0",  # ts = NaN
    ]
    while len(out) < n:
        r = rng.random()
        if r < 0.45:
            form = "map" if rng.random() < 0.7 else "array"
            out.append(_mutate(rng, encode_batch(_valid_batch_objects(rng), form)))
        elif r < 0.6:
            out.append(msgspec.msgpack.encode(_random_value(rng)))
        elif r < 0.85:
            out.append(msgspec.msgpack.encode(_near_valid(rng)))
        elif r < 0.9:
            out.append(encode_batch(_valid_batch_objects(rng), rng.choice(["map", "array"])))
        elif r < 0.95:
            insane = _valid_batch_objects(rng, insane=True)
            out.append(encode_batch(insane, rng.choice(["map", "array"])))
        else:
            out.append(rng.randbytes(rng.randrange(64)))
    return out[:n]


def hypothesis_payloads(n: int, seed: int = 0) -> list[bytes]:
    """``n`` structure-aware payloads generated by hypothesis (edge-biased values in
    batch-shaped msgpack, both event forms, and mutations of encoded batches)."""
    import msgspec
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    scalar = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)
        | st.floats()
        | st.text(max_size=12)
        | st.binary(max_size=12)
        | st.sampled_from(_ODD)
    )
    value = st.recursive(scalar, lambda c: st.lists(c, max_size=4), max_leaves=8)
    name = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]) | scalar
    as_map = st.builds(
        lambda k, fields: {"type": k, **fields},
        name,
        st.dictionaries(st.sampled_from(_FIELDS[1:]), value, max_size=6),
    )
    as_array = st.builds(lambda k, vals: [k, *vals], name, st.lists(value, max_size=12))
    batch = st.tuples(scalar, st.lists(as_map | as_array, max_size=3), scalar)
    encoded = batch.map(lambda b: msgspec.msgpack.encode(list(b))) | value.map(
        msgspec.msgpack.encode
    )
    mutated = st.tuples(encoded, st.integers(0, 2**32)).map(
        lambda t: _mutate(random.Random(t[1]), t[0])
    )
    out: list[bytes] = []

    @hseed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(encoded | mutated)
    def collect(payload: bytes) -> None:
        out.append(payload)

    collect()
    return out


async def fuzz_events(
    payloads: list[bytes], *, transport: str = "inproc", chunk: int = 500
) -> dict[str, Any]:
    """Publish every payload as one frame (contiguous seqs) into a real subscriber feeding
    ``IngestManager`` + ``MemoryIndex``, plus frames of the wrong shape; everything must
    be counted (a decoded batch or an undecodable one) and nothing may crash the feed.
    A valid marker batch closes each chunk; the last one must still reach the index."""
    import zmq
    from prometheus_client import CollectorRegistry

    from events.codec import encode_batch
    from events.structs import BlockStored, KVEventBatch
    from router.index import MemoryIndex
    from router.ingest import IngestManager

    if transport == "inproc":
        endpoint = f"inproc://kvroute-chaos-fuzz-{uuid.uuid4().hex}"
    else:
        endpoint = f"tcp://{LOOPBACK}:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    index, reg = MemoryIndex(), CollectorRegistry()
    mgr = IngestManager(index, registry=reg, heartbeat_s=None, cursor_check_s=None)
    name = "fuzzed"
    seq = 0

    def send(payload: bytes) -> int:
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        return seq - 1

    def marker(block: int | None = None) -> int:
        events = [] if block is None else [BlockStored([block], None, [], 16, None, "GPU", None)]
        return send(encode_batch(KVEventBatch(ts=time.time(), events=events)))  # type: ignore[arg-type]

    def m(metric: str, **labels: str) -> float:
        return reg.get_sample_value(metric, {"instance": name, **labels}) or 0.0

    res: dict[str, Any] = {"fault": f"msgpack fuzz ({transport})"}
    t0 = time.monotonic()
    try:
        await mgr.add_instance(name, endpoint)
        for _ in range(200):  # the subscription must reach the PUB before counting starts
            try:
                await mgr.wait_for_seq(name, marker(), timeout=0.05)
                break
            except TimeoutError:
                continue
        else:
            raise RuntimeError("fuzz subscriber never caught up")
        await asyncio.sleep(0.1)
        await mgr.wait_for_seq(name, marker(), timeout=10)
        base_batches = m("kvroute_ingest_batches_total", source="live")
        base_bad = m("kvroute_ingest_undecodable_total")
        markers = ignored = 0
        for i in range(0, len(payloads), chunk):
            for p in payloads[i : i + chunk]:
                send(p)
            # Each chunk ends with a real batch storing a new block. It is always handled;
            # it is not applied when garbage before it carried a ts slightly ahead of ours
            # (the index orders batches by (ts, seq)): counted, not a failure.
            block = 0xC0FFEE0000 + i
            await mgr.wait_for_seq(name, marker(block), timeout=60)
            markers += 1
            ignored += (await index.lookup([block], [name])).get(name) != {0: 1}
        shapes = [[b""], [b"", b"\x00" * 8], [b"", b"\x00" * 7, b"x"], [b"", b"", b"", b""]]
        for frames in shapes:
            pub.send_multipart(frames)
        last = marker()
        markers += 1
        await mgr.wait_for_seq(name, last, timeout=30)
        batches = m("kvroute_ingest_batches_total", source="live") - base_batches
        bad = m("kvroute_ingest_undecodable_total") - base_bad
        res["injected"] = len(payloads) + len(shapes)
        res["decoded"] = int(batches) - markers
        res["undecodable"] = int(bad)
        res["uncounted"] = res["injected"] - res["decoded"] - res["undecodable"]
        res["invalid_events"] = sum(
            m("kvroute_ingest_events_total", type=t, status="invalid")
            for t in ("BlockStored", "BlockRemoved")
        )
        res["feed_errors"] = m("kvroute_ingest_errors_total")
        res["markers"] = markers
        res["markers_stale"] = ignored
        res["lost_count"] = abs(res["uncounted"]) + int(res["feed_errors"])
    finally:
        await mgr.close()
        pub.close(0)
    res["wall_s"] = time.monotonic() - t0
    res["requests"] = None
    res["recovery_s"] = None
    return res


# ---- scenario: garbage over HTTP ------------------------------------------------------

_PATHS = ("/v1/completions", "/v1/chat/completions")
_CONTENT_TYPES = [b"application/json", b"text/plain", b"application/x-www-form-urlencoded"]
_CONTENT_TYPES += [b"multipart/form-data; boundary=x", b"application/json; charset=latin-1", b""]
_SPECIAL_HEADERS = [
    (b"content-encoding", b"gzip"),
    (b"accept-encoding", b"br, gzip, zstd"),
    (b"authorization", b"Bearer \xff\xfe"),
    (b"x-kvroute-instance", b"http://127.0.0.1:9/"),
    (b"x-forwarded-host", b"127.0.0.1:9"),
    (b"accept", b"text/event-stream"),
    (b"x-request-id", "caf\u00e9".encode("latin-1")),
    (b"cookie", b"a=" + b"b" * 4000),
]


def _valid_body(rng: random.Random, path: str) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": rng.randrange(0, 12), "stream": rng.random() < 0.5}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": f"hello {rng.random()}"}]
    else:
        body["prompt"] = rng.choice([f"fuzz {rng.random()}", [rng.randrange(256)] * 5])
    if rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    return body


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.5:
        return rng.choice(
            [
                None,
                True,
                0,
                -1,
                2**70,
                1.5,
                float("nan"),
                float("inf"),
                "",
                "x" * 50,
                "\u00e9\U0001f600",
            ]
        )
    if r < 0.75:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    keys = ["prompt", "messages", "max_tokens", "stream", "model", "role", "content", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def http_cases(n: int, seed: int = 0) -> list[tuple[str, list[tuple[bytes, bytes]], bytes]]:
    """``n`` (path, headers, body) cases: mutated valid bodies, valid bodies with one field
    replaced by junk, random JSON, raw bytes, classics (deep nesting, huge numbers, bad
    UTF-8); headers with odd content types, latin-1 values and routing-looking names."""
    rng = random.Random(seed)
    classics = [
        b"",
        b"null",
        b"[]",
        b'"prompt"',
        b"[" * 100_000,
        b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"prompt": "x", "max_tokens": 1e999}',
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "\xff\xfe"}',
        b"\xef\xbb\xbf{}",
        b'{"prompt": [1, 2, -1]}',
        b'{"prompt": [340282366920938463463374607431768211456]}',
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        b'{"messages": [{"content": {"a": 1}}]}',
        b'{"prompt": "x", "stream": true, "stream_options": 5}',
        b'{"prompt": "x", "model": "http://127.0.0.1:9/v1"}',
    ]
    out = []
    for i in range(n):
        path = rng.choice(_PATHS)
        r = rng.random()
        if i < len(classics):
            body = classics[i]
        elif r < 0.3:
            body = _mutate(rng, json.dumps(_valid_body(rng, path)).encode())
        elif r < 0.55:
            b = _valid_body(rng, path)
            b[rng.choice([*b, "model", "n"])] = _random_json(rng)
            body = json.dumps(b).encode()
        elif r < 0.8:
            body = json.dumps(_random_json(rng)).encode()
        elif r < 0.9:
            body = rng.randbytes(rng.randrange(200))
        else:
            body = json.dumps(_valid_body(rng, path)).encode()
        headers = [(b"content-type", rng.choice(_CONTENT_TYPES))]
        for _ in range(rng.randrange(4)):
            if rng.random() < 0.4:
                headers.append(rng.choice(_SPECIAL_HEADERS))
            else:
                key = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789-", k=8))
                value = bytes(
                    rng.choice([*range(0x20, 0x7F), *range(0x80, 0x100)]) for _ in range(12)
                )
                headers.append((b"x-" + key.encode(), value.strip() or b"v"))
        out.append((path, headers, body))
    return out


def judge_http(status: int, content_type: str, raw: bytes) -> str | None:
    """None if the answer is acceptable: a 2xx with a well-formed body, or a 4xx (or 502,
    503, 504) whose JSON body carries ``error``; else what is wrong."""
    if 200 <= status < 300:
        if "text/event-stream" in content_type:
            lines = [ln for ln in raw.decode(errors="replace").splitlines() if ln]
            for ln in lines:
                if ln != "data: [DONE]":
                    json.loads(ln.removeprefix("data: "))
            if not lines or lines[-1] != "data: [DONE]":
                return f"stream without [DONE]: {raw[-200:]!r}"
            return None
        try:
            json.loads(raw)
        except ValueError:
            return f"{status} with a non-JSON body: {raw[:200]!r}"
        return None
    if not (400 <= status < 500 or status in (502, 503, 504)):
        return f"status {status}: {raw[:200]!r}"
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without a JSON error body: {raw[:200]!r}"
    if not isinstance(err, dict) or "message" not in err:
        return f"{status} error body without a message: {raw[:200]!r}"
    return None


async def fuzz_http(
    target: str, cases: list[tuple[str, list[tuple[bytes, bytes]], bytes]], *, concurrency: int = 8
) -> dict[str, Any]:
    """Send every case to ``target``; each must be judged fine within 30 s, and the target
    must answer ``/health`` afterwards."""
    problems: list[str] = []
    statuses: dict[int, int] = {}
    sem = asyncio.Semaphore(concurrency)
    async with new_client(concurrency + 2, timeout=30) as client:

        async def one(i: int, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
            async with sem:
                try:
                    async with asyncio.timeout(30):
                        r = await client.post(target + path, content=body, headers=headers)
                except Exception as exc:
                    problems.append(f"case {i} {path} {body[:80]!r}: {type(exc).__name__} {exc}")
                    return
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                verdict = judge_http(r.status_code, r.headers.get("content-type", ""), r.content)
                if verdict is not None:
                    problems.append(f"case {i} {path} {body[:80]!r} {headers}: {verdict}")

        t0 = time.monotonic()
        await asyncio.gather(*(one(i, *case) for i, case in enumerate(cases)))
        wall = time.monotonic() - t0
        health = (await client.get(f"{target}/health")).status_code
    return {
        "injected": len(cases),
        "problems": problems,
        "statuses": dict(sorted(statuses.items())),
        "healthy_after": health == 200,
        "wall_s": wall,
        "lost_count": len(problems) + (health != 200),
    }


def _raw_exchange(
    port: int, head: bytes, body: Iterator[bytes], timeout: float
) -> tuple[bytes, int]:
    """Send ``head`` then ``body`` pieces until the server answers; return (answer, body
    bytes sent). Reads as soon as the socket is readable, so an early answer is seen."""
    import select

    sent = 0
    answer = b""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
        s.sendall(head)
        deadline = time.monotonic() + timeout
        for piece in body:
            if select.select([s], [], [], 0)[0]:
                break
            try:
                s.sendall(piece)
            except OSError:  # the server answered and closed: read what it said
                break
            sent += len(piece)
            if time.monotonic() > deadline:
                break
        s.settimeout(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(OSError):
            while True:
                data = s.recv(65536)
                if not data:
                    break
                answer += data
                if b"\r\n\r\n" in answer and _complete(answer):
                    break
    return answer, sent


def _complete(answer: bytes) -> bool:
    head, _, rest = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
    return False


def oversize_checks(port: int, path: str, limit: int) -> dict[str, Any]:
    """A body over ``limit`` must be refused with 413 before it is read whole: (1) a
    Content-Length announcing 10 GB (only 1 KiB follows), (2) a chunked body that would
    never end (the answer must come after about ``limit`` bytes)."""
    out: dict[str, Any] = {}
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\ncontent-type: application/json\r\n"
    ).encode()
    t0 = time.monotonic()
    answer, _ = _raw_exchange(
        port, head + b"content-length: 10000000000\r\n\r\n", iter([b"{" + b" " * 1023]), 15
    )
    out["announced"] = {
        "status": _status(answer),
        "body": _body(answer),
        "s": time.monotonic() - t0,
    }

    piece = b" " * 65536
    pieces = (limit + (64 << 20)) // len(piece)

    def endless() -> Iterator[bytes]:
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        for _ in range(pieces):
            yield frame

    t0 = time.monotonic()
    answer, sent = _raw_exchange(port, head + b"transfer-encoding: chunked\r\n\r\n", endless(), 60)
    out["chunked"] = {
        "status": _status(answer),
        "body": _body(answer),
        "sent_bytes": sent,
        "offered_bytes": pieces * (len(piece) + 8),
        "s": time.monotonic() - t0,
    }
    return out


def _status(answer: bytes) -> int | None:
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def _body(answer: bytes) -> Any:
    rest = answer.partition(b"\r\n\r\n")[2]
    try:
        return json.loads(rest)
    except ValueError:
        return rest[:200].decode(errors="replace")


# ---- the whole run ----------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 0.1 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """In-process scenarios log a warning per fault they inject: keep the table readable."""
    import logging

    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


async def _run_all(
    workdir: Path,
    *,
    streams: int,
    kill_requests: int,
    fuzz_payloads: int,
    hypothesis_examples: int,
    http_cases_per_target: int,
    seed: int,
    only: set[str] | None,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def want(name: str) -> bool:
        return only is None or name in only

    if want("kill"):
        with Fleet(workdir / "kill") as fleet:
            r = await engine_kill(fleet, requests=kill_requests)
        r["notes"] = (
            f"{len(r['broken_streams'])} started streams ended with an error chunk, "
            f"{r['sent_after_kill']} requests sent after the kill; down detected in "
            f"{r['detect_down_s']:.2f}s; recovery = restart -> index rebuilt (engine start "
            f"{r['restart_s']:.1f}s)"
        )
        rows.append(r)
    if want("events"):
        for buffer_steps in (10_000, 8):
            with _quiet("events.subscriber", "router.ingest", "router.layout"):
                r = await dropped_events(drop=20, buffer_steps=buffer_steps, seed=seed)
            r["requests"] = r["batches"]
            r["notes"] = (
                f"requests = batches published; lost = stale index entries; right after the "
                f"gap {r['missing_after_gap']} entries missing (history), at the end "
                f"{r['missing']}/{r['truth_entries']}; gaps {r['gaps']:.0f}, resyncs "
                f"{r['resyncs']:.0f}"
            )
            rows.append(r)
    if want("redis"):
        with Fleet(workdir / "redis") as fleet:
            r = await redis_outage(fleet)
        r["notes"] = (
            f"fallback to load-only seen: {r['fallback_seen']}; lookups back after "
            f"{r['index_back_s']:.2f}s; recovery = restart -> history rebuilt"
        )
        rows.append(r)
    if want("fuzz"):
        hyp = hypothesis_payloads(hypothesis_examples, seed) if hypothesis_examples else []
        payloads = hyp + random_payloads(fuzz_payloads - len(hyp), seed)
        tcp_n = min(1000, len(payloads) // 10)
        with _quiet("events.subscriber", "router.ingest", "router.layout"):
            a = await fuzz_events(payloads[tcp_n:], transport="inproc")
            b = await fuzz_events(payloads[:tcp_n], transport="tcp")
        rows.append(
            {
                "fault": "msgpack fuzz -> subscriber + ingest",
                "injected": a["injected"] + b["injected"],
                "requests": None,
                "lost_count": a["lost_count"] + b["lost_count"],
                "recovery_s": None,
                "notes": (
                    f"{len(hyp)} from hypothesis; {a['decoded'] + b['decoded']} decoded, "
                    f"{a['undecodable'] + b['undecodable']} counted undecodable, "
                    f"{a['invalid_events'] + b['invalid_events']:.0f} invalid events dropped; "
                    f"lost = uncounted + feed errors"
                ),
                "inproc": a,
                "tcp": b,
            }
        )
    if want("http"):
        with Fleet(workdir / "http") as fleet:
            (eng,) = start_engines(
                fleet, 1, "--profile", "full", "--time-scale", "50", "--max-model-len", "1024"
            )
            router = fleet.router([eng], env={"KVROUTE_MAX_BODY_BYTES": str(1 << 20)})
            for name, proc in (("router", router), ("engine", eng)):
                cases = http_cases(http_cases_per_target, seed + (name == "engine"))
                r = await fuzz_http(proc.url, cases)
                limit = 1 << 20 if name == "router" else 16 << 20
                over = await asyncio.to_thread(oversize_checks, proc.port, "/v1/completions", limit)
                refused = [over[k]["status"] == 413 for k in ("announced", "chunked")]
                r.update(
                    fault=f"HTTP fuzz -> {name}",
                    requests=len(cases),
                    recovery_s=None,
                    oversize=over,
                    notes=(
                        f"statuses {r['statuses']}; oversize bodies refused with 413: "
                        f"{sum(refused)}/2 (chunked: after {over['chunked']['sent_bytes'] >> 20}"
                        f" MiB of a {limit >> 20} MiB limit)"
                    ),
                )
                r["lost_count"] += refused.count(False)
                rows.append(r)
    if want("load"):
        with Fleet(workdir / "load") as fleet:
            r = await stream_load(fleet, streams=streams, rounds=2)
        after = " / ".join(f"{v:.0f}" for v in r["rss_after_mb"])
        r["fault"] = f"{streams} concurrent streams, twice"
        r["notes"] = (
            f"{r['distinct_ids']} distinct response ids; router RSS {r['rss_baseline_mb']:.0f}"
            f" MB warm -> peak {r['rss_peak_mb']:.0f} -> {after} MB after each round; wall "
            + " / ".join(f"{w:.1f}s" for w in r["wall_s"])
        )
        rows.append(r)
    return rows


def run(
    out: Path,
    *,
    streams: int = 1000,
    kill_requests: int = 60,
    fuzz_payloads: int = 10_000,
    hypothesis_examples: int = 2000,
    http_cases_per_target: int = 300,
    seed: int = 0,
    only: set[str] | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Run the fault scenarios (``only``: a subset of kill, events, redis, fuzz, http,
    load), print the table and write ``out/chaos.json``."""
    from rich.console import Console
    from rich.table import Table

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvroute-chaos-") as tmp:
        base = Path(workdir or tmp)
        for sub in ("kill", "redis", "http", "load"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        rows = asyncio.run(
            _run_all(
                base,
                streams=streams,
                kill_requests=kill_requests,
                fuzz_payloads=fuzz_payloads,
                hypothesis_examples=hypothesis_examples,
                http_cases_per_target=http_cases_per_target,
                seed=seed,
                only=only,
            )
        )
    report = {
        "figures": [
            {
                "fault": r["fault"],
                "injected": r.get("injected"),
                "requests": r.get("requests"),
                "lost": r.get("lost_count"),
                "recovery_s": r.get("recovery_s"),
                "notes": r.get("notes", ""),
            }
            for r in rows
        ],
        "details": rows,
        "wall_s": time.monotonic() - t0,
    }
    path = write_report(out, "chaos", report)
    table = Table(title="kvroute bench chaos: faults injected and what they cost")
    for col in ("fault", "injected", "requests", "lost", "recovery s", "notes"):
        table.add_column(col, justify="left" if col in ("fault", "notes") else "right")
    for f in report["figures"]:
        table.add_row(
            f["fault"],
            _fmt(f["injected"]),
            _fmt(f["requests"]),
            _fmt(f["lost"]),
            _fmt(f["recovery_s"]),
            f["notes"],
        )
    console = Console(width=200)
    console.print(table)
    console.print(f"report: {path}")
    return report
