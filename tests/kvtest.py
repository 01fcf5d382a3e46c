"""Test kit shared across test packages: free ports, real engine processes, HTTP waits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.chaos.procs import free_port, ipc_endpoint, wait_http
from bench.replay.procs import EventForwarder

REPO = Path(__file__).resolve().parent.parent
KVROUTE = [sys.executable, "-m", "kvroute_cli.main"]


@dataclass
class EngineProc:
    """A real ``kvroute engine`` process on loopback."""

    proc: subprocess.Popen
    port: int
    events_port: int
    replay_port: int
    log: Path
    events: str  # where subscribers connect for the engine's KV events

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def _wait_up(p: EngineProc | RouterProc, what: str) -> None:
    """Wait for ``p``'s /health; if it never comes, kill ``p`` and raise with its log tail."""
    try:
        wait_http(f"{p.url}/health", proc=p.proc)
    except Exception:
        p.stop(signal.SIGKILL)
        raise RuntimeError(f"{what} failed to start:\n{p.log.read_text()[-3000:]}") from None


def start_engine(
    tmp: Path,
    *args: str,
    port: int | None = None,
    events_port: int | None = None,
    replay_port: int | None = None,
    forwarder: EventForwarder | None = None,
    wait: bool = True,
) -> EngineProc:
    """Events go to an ipc socket named by ``events_port`` (restarting with the same one
    rebinds where subscribers reconnect); with ``forwarder``, for consumers that take
    tcp:// only, the engine's PUB connects to that loopback relay instead."""
    port = port or free_port()
    events_port = events_port or free_port()
    replay_port = replay_port or free_port()
    if forwarder is None:
        endpoint = events = ipc_endpoint(f"ev-{events_port}")
    else:
        endpoint = f"tcp://127.0.0.1:{forwarder.in_port}"
        events = f"tcp://127.0.0.1:{forwarder.out_port}"
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": endpoint,
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    log = tmp / f"engine-{port}.log"
    cmd = [*KVROUTE, "engine", "--port", str(port), "--kv-events-config", json.dumps(cfg), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env)
    eng = EngineProc(proc, port, events_port, replay_port, log, events)
    if wait:
        _wait_up(eng, "engine")
    return eng


@contextlib.contextmanager
def engines(
    tmp: Path, count: int, *args: str, forwarders: Sequence[EventForwarder] | None = None
) -> Iterator[list[EngineProc]]:
    procs: list[EngineProc] = []
    try:
        for i in range(count):
            fwd = forwarders[i] if forwarders else None
            procs.append(start_engine(tmp, *args, forwarder=fwd, wait=False))
        for e in procs:
            wait_http(f"{e.url}/health", proc=e.proc)
        yield procs
    finally:
        for e in procs:
            e.stop()


@dataclass
class RouterProc:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        return EngineProc.stop(self, sig, timeout)  # type: ignore[arg-type]


def instance_arg(e: EngineProc) -> str:
    return f"{e.url}={e.events},replay={e.replay}"


def start_router(
    tmp: Path, engines_: list[EngineProc], *args: str, env: dict[str, str] | None = None
) -> RouterProc:
    port = free_port()
    cmd = [*KVROUTE, "router", "--port", str(port), "--health-interval", "0.5"]
    for e in engines_:
        cmd += ["--instance", instance_arg(e)]
    log = tmp / f"router-{port}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [*cmd, *args],
            cwd=REPO,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    r = RouterProc(proc, port, log)
    _wait_up(r, "router")
    return r


def start_redis(port: int | None = None) -> tuple[subprocess.Popen, int]:
    """A private redis-server on loopback (persistence off); the caller stops it."""
    import shutil

    import redis

    port = port or free_port()
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return proc, port
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("private redis-server did not start") from None
            time.sleep(0.02)


def child_pids(pid: int) -> set[int]:
    """The live children of ``pid`` (from /proc): what a supervisor must not leave behind."""
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.add(int(entry.name))
    return out


def send_turns(router_url: str, prompt: str, turns: int = 3) -> str:
    """``turns`` completions sharing ``prompt`` through a router; the last one's instance."""
    import httpx

    holder = ""
    for turn in range(turns):
        r = httpx.post(
            f"{router_url}/v1/completions",
            json={"prompt": prompt + f" turn {turn}", "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        holder = r.headers["x-kvroute-instance"]
    return holder
