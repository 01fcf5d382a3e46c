"""Child processes for the chaos scenarios: engines, routers and Redis on loopback."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent.parent
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


@functools.cache
def _socket_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvr-"))  # short: ipc paths hold 107 bytes at most
    atexit.register(shutil.rmtree, d, True)
    return d


def ipc_endpoint(name: str) -> str:
    """A ZMQ endpoint a vLLM-style PUB binds (vLLM binds ``ipc://``, connects to a loopback
    ``tcp://`` address) yet no other machine can reach: engines started by tests, demos and
    benchmarks publish events here instead of on ``tcp://*``. Same name, same path, so an
    engine restarted with it rebinds where its subscribers reconnect."""
    return f"ipc://{_socket_dir() / name}"


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
        self.procs: list[Proc] = []

    def engine(self, *args: str, wait: bool = True, name: str | None = None) -> Proc:
        port, replay_port = free_port(), free_port()
        cfg = {
            "enable_kv_cache_events": True,
            "endpoint": ipc_endpoint(f"ev-{port}"),
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
