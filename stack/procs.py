"""One process supervisor for everything that starts kvroute on loopback: the demo
(``kvroute up``), the chaos scenarios, the benchmarks and the tests.

Why one: engines, routers and Redis are started the same way everywhere (log file per
child, health wait that fails fast with the log's tail, SIGTERM then SIGKILL), and ports
and ``ipc://`` event endpoints must never collide between helpers of one process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

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


@functools.cache
def _socket_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvr-"))  # short: ipc paths hold 107 bytes at most
    atexit.register(shutil.rmtree, d, True)
    return d


def ipc_endpoint(name: str) -> str:
    """A ZMQ endpoint a vLLM-style PUB binds (vLLM binds ``ipc://``, connects to a loopback
    ``tcp://`` address) yet no other machine can reach: engines started by tests, demos and
    benchmarks publish events here instead of on ``tcp://*``. Same name, same path for the
    life of the process (one socket directory, made on first use, removed at exit), so an
    engine restarted with it rebinds where its subscribers reconnect
    (``tests/stack/test_procs.py``)."""
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
    inherit_env: bool = True  # False: ``env`` is the whole environment (real vLLM's)
    proc: subprocess.Popen | None = None
    health_path: str | None = "/health"
    # Engines: where they publish (ipc:// binds a socket file, reachable only locally).
    events: str | None = None
    replay: str | None = None
    redis_password: str | None = None  # redis-server started with --requirepass

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def replay_port(self) -> int | None:
        """An engine's replay port (restart it with the same one to keep its endpoints)."""
        return int(self.replay.rsplit(":", 1)[1]) if self.replay else None

    def instance_arg(self) -> str:
        return f"{self.url}={self.events},replay={self.replay}"

    def launch(self, *, detach: bool = False) -> Proc:
        """Start the command, output appended to ``log``. ``detach`` (the demo): own session,
        so a terminal Ctrl-C reaches only the supervisor, and SIGTERM when it dies."""
        base = os.environ if self.inherit_env else {}
        with self.log.open("ab") as fh:
            fh.write(f"$ {' '.join(self.cmd)}\n".encode())
            fh.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**base, **self.env, "PYTHONUNBUFFERED": "1"},
                start_new_session=detach,
                preexec_fn=die_with_parent() if detach else None,
            )
        return self

    def wait_ready(self, timeout: float = 60.0) -> Proc:
        assert self.proc is not None
        try:
            if self.health_path is not None:
                wait_http(self.url + self.health_path, timeout, self.proc)
            else:
                _wait_redis(self.port, timeout, self.proc, self.redis_password)
        except Exception:
            self.kill()
            raise RuntimeError(f"{self.name} failed to start:\n{self.tail()}") from None
        return self

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye (sockets close as the process dies)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Send ``sig`` (SIGTERM: a graceful drain), wait, SIGKILL if it lingers; the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return None if self.proc is None else self.proc.returncode

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def redis_command(port: int, workdir: Path) -> list[str]:
    """A throw-away ``redis-server``: loopback only, no RDB, no AOF, files in ``workdir``."""
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    return [exe, "--port", str(port), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]  # fmt: skip


@dataclass(frozen=True)
class RedisServer:
    url: str  # redis://127.0.0.1:PORT/0
    unix_url: str  # unix://PATH, the same server over its socket
    port: int


@contextlib.contextmanager
def private_redis(password: str | None = None) -> Iterator[RedisServer]:
    """A throw-away redis-server on a free port and a unix socket (``password``: required
    of clients); stopped on exit."""
    with Fleet() as fleet:
        sock = fleet.dir / "redis.sock"
        p = fleet.redis(None, "--unixsocket", str(sock), password=password)
        yield RedisServer(f"redis://{LOOPBACK}:{p.port}/0", f"unix://{sock}", p.port)


def _wait_redis(port: int, timeout: float, proc: subprocess.Popen, password: str | None) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis(host=LOOPBACK, port=port, password=password, socket_timeout=1).ping()
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

    def engine(
        self,
        *args: str,
        wait: bool = True,
        name: str | None = None,
        port: int | None = None,
        replay_port: int | None = None,
        forwarder: EventForwarder | None = None,
        quiet: bool = True,
    ) -> Proc:
        """A ``kvroute engine`` publishing on an ipc socket named after its port (restarted
        with the same port, it rebinds where subscribers reconnect); with ``forwarder``, for
        consumers that take tcp:// only, its PUB connects to that loopback relay instead.
        ``quiet``: warnings only in its log (else uvicorn's lifecycle lines too)."""
        port, replay_port = port or free_port(), replay_port or free_port()
        endpoint = events = ipc_endpoint(f"ev-{port}")
        if forwarder is not None:
            endpoint, events = forwarder.in_endpoint, forwarder.out_endpoint
        cmd = [*KVROUTE, "--log-level", "WARNING" if quiet else "INFO", "engine"]
        cmd += ["--port", str(port)]
        cmd += ["--kv-events-config", kv_events_config(endpoint, f"tcp://{LOOPBACK}:{replay_port}")]
        cmd += ["--log-level", "warning" if quiet else "info", *args]
        p = Proc(name or f"engine-{port}", cmd, port, self.dir / f"engine-{port}.log")
        p.events, p.replay = events, f"tcp://{LOOPBACK}:{replay_port}"
        self.procs.append(p.launch())
        return p.wait_ready() if wait else p

    def restart(self, p: Proc) -> Proc:
        """Start a killed process again with the same command line (same ports)."""
        assert not p.alive
        deadline = time.monotonic() + 10
        while not _port_free(p.port) and time.monotonic() < deadline:
            time.sleep(0.05)
        return p.launch()

    def router(
        self,
        engines: list[Proc],
        *args: str,
        env: dict[str, str] | None = None,
        quiet: bool = True,
    ) -> Proc:
        port = free_port()
        level = "warning" if quiet else "info"
        cmd = [*KVROUTE, "--log-level", level.upper(), "router", "--port", str(port)]
        cmd += ["--health-interval", "0.5", "--log-level", level]
        for e in engines:
            cmd += ["--instance", e.instance_arg()]
        p = Proc(f"router-{port}", [*cmd, *args], port, self.dir / f"router-{port}.log", env or {})
        self.procs.append(p.launch())
        return p.wait_ready()

    def redis(self, port: int | None = None, *args: str, password: str | None = None) -> Proc:
        """A private ``redis-server`` on loopback, nothing persisted (``args``: more options;
        ``password``: required of clients, and used by the readiness check)."""
        port = port or free_port()
        cmd = [*redis_command(port, self.dir), *args]
        if password is not None:
            cmd += ["--requirepass", password]
        p = Proc(f"redis-{port}", cmd, port, self.dir / f"redis-{port}.log", health_path=None)
        p.redis_password = password
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


def kv_events_config(endpoint: str, replay: str) -> str:
    """vLLM's ``--kv-events-config`` JSON for a publisher at ``endpoint`` with replay."""
    return json.dumps(
        {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay}
    )


@functools.cache
def die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook (Linux): the child gets SIGTERM if its supervisor dies, even by
    SIGKILL, so no engine outlives ``kvroute up`` holding its ports. libc is resolved here,
    in the parent: the hook runs between fork and exec, where loading a library could
    deadlock (a progress bar's thread may hold the loader lock)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def hook() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return hook


class EventForwarder:
    """One XSUB->XPUB relay, both bound on 127.0.0.1.

    vLLM's rule makes a PUB bind only for wildcard or ipc endpoints, so a loopback tcp
    PUB *connects*: the engine pushes into our XSUB, and routers subscribe at our XPUB
    (vllm-router takes tcp:// sources only; a wildcard would leave loopback). Frames pass
    through untouched; ``zmq.proxy_steerable`` runs in C, off the GIL.
    """

    def __init__(self, ctx: zmq.Context) -> None:
        self.in_port, self.out_port = free_port(), free_port()
        self._xsub = ctx.socket(zmq.XSUB)
        self._xpub = ctx.socket(zmq.XPUB)
        for sock in (self._xsub, self._xpub):
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.LINGER, 0)
        self._xsub.bind(self.in_endpoint)
        self._xpub.bind(self.out_endpoint)
        addr = f"inproc://fwd-{id(self)}"
        self._ctl = ctx.socket(zmq.PAIR)
        self._ctl.bind(addr)
        self._ctl_peer = ctx.socket(zmq.PAIR)
        self._ctl_peer.connect(addr)
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-forwarder")
        self._thread.start()

    @property
    def in_endpoint(self) -> str:  # where the engine's PUB connects
        return f"tcp://{LOOPBACK}:{self.in_port}"

    @property
    def out_endpoint(self) -> str:  # where routers subscribe
        return f"tcp://{LOOPBACK}:{self.out_port}"

    def _run(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            zmq.proxy_steerable(self._xsub, self._xpub, None, self._ctl_peer)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._ctl.send(b"TERMINATE")
        self._thread.join(5)
        for sock in (self._xsub, self._xpub, self._ctl, self._ctl_peer):
            sock.close(linger=0)


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


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc (MB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
