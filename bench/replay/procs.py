"""Real processes on loopback for live replays: engines, our router, the peer routers.

Every process logs to a file under the run directory, is stopped with SIGTERM then
SIGKILL after a bounded wait, and is only ever bound to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq

from bench.replay.config import ReplayConfig, checkout_kvroute
from stack.procs import KVROUTE, EventForwarder, Proc, free_port, private_redis, wait_http

__all__ = [
    "EngineHandle",
    "Proc",
    "cpu_seconds",
    "free_port",
    "pid_listening",
    "router_command",
    "running_engines",
    "running_router",
    "wait_healthy",
]

log = logging.getLogger(__name__)

BIN = Path(sys.executable).parent


def spawn(name: str, cmd: Sequence[str], logdir: Path) -> Proc:
    logdir.mkdir(parents=True, exist_ok=True)
    return Proc(name, list(cmd), 0, logdir / f"{name}.log").launch()


def wait_healthy(url: str, proc: Proc, timeout: float) -> None:
    """``url`` answers 200, or raise with the log's tail (the process died or hung)."""
    assert proc.proc is not None
    try:
        wait_http(url, timeout, proc.proc)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{proc.name}: {exc}\n{proc.tail(2000)}") from None


@dataclass
class EngineHandle:
    """A running engine; routers read its events at ``events`` (the forwarder's XPUB)
    and replay from its own ROUTER at ``replay``."""

    name: str  # engine-i, what records and plots call it
    port: int
    events_port: int
    replay_port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host_port(self) -> str:  # how the engine names itself (system_fingerprint)
        return f"127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


@contextlib.contextmanager
def running_engines(
    cfg: ReplayConfig, logdir: Path, timeout: float = 120.0
) -> Iterator[list[EngineHandle]]:
    """``cfg.engines`` fresh ``kvroute engine`` processes publishing KV events (bind)."""
    handles: list[EngineHandle] = []
    ctx = zmq.Context()
    forwarders: list[EventForwarder] = []
    try:
        for i in range(cfg.engines):
            port, rp = free_port(), free_port()
            fwd = EventForwarder(ctx)
            forwarders.append(fwd)
            events_cfg = {
                "enable_kv_cache_events": True,
                "endpoint": fwd.in_endpoint,
                "replay_endpoint": f"tcp://127.0.0.1:{rp}",
            }
            cmd = [*KVROUTE, "--log-level", "WARNING", "engine", "--host", "127.0.0.1"]
            cmd += ["--port", str(port), "--model", cfg.model, "--log-level", "warning"]
            cmd += ["--kv-events-config", json.dumps(events_cfg)]
            cmd += cfg.engine.cli_args(cfg.time_scale)
            proc = spawn(f"engine-{i}", cmd, logdir)
            handles.append(EngineHandle(f"engine-{i}", port, fwd.out_port, rp, proc))
        for h in handles:
            wait_healthy(f"{h.url}/health", h.proc, timeout)
        yield handles
    finally:
        for h in handles:
            h.proc.stop()
        for f in forwarders:
            f.close()
        ctx.term()


def router_command(
    kind: str,
    policy: str,
    port: int,
    engines: Sequence[EngineHandle],
    cfg: ReplayConfig,
    index: str = "memory",
) -> list[str]:
    """The command line for ``ours`` / ``vllm-router`` / ``sglang-router`` (``ours``'s
    ``POLICY*N``: N workers, on ``index``; ``POLICY@CHECKOUT``: that checkout's router)."""
    urls = [e.url for e in engines]
    if kind == "ours":
        policy, _, checkout = policy.partition("@")
        policy, _, workers = policy.partition("*")
        exe = [str(checkout_kvroute(checkout))] if checkout else KVROUTE
        cmd = [*exe, "--log-level", "WARNING", "router", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--policy", policy, "--index", index]
        if workers:
            cmd += ["--workers", workers]
        cmd += ["--block-size", str(cfg.engine.block_size), "--hash-algo", cfg.engine.hash_algo]
        cmd += ["--model", cfg.model, "--log-level", "warning"]
        if cfg.temperature:
            cmd += ["--temperature", str(cfg.temperature)]
        for e in engines:
            cmd += ["--instance", f"{e.url}={e.events},replay={e.replay}"]
        return cmd
    prom = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if kind == "vllm-router":
        cmd = [str(BIN / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--policy", "kv_aware", "--worker-urls", *urls]
        for e in engines:
            cmd += ["--kv-event-source", f"{e.url}={e.events}"]
            cmd += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
        cmd += ["--kv-event-model", cfg.model, "--kv-event-block-size", str(cfg.engine.block_size)]
        cmd += ["--health-check-interval-secs", "1", "--log-level", "warning", *prom]
        return cmd
    if kind == "sglang-router":
        cmd = [str(BIN / "sglang-router"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--policy", "cache_aware", "--worker-urls", *urls]
        cmd += ["--health-check-interval-secs", "1", "--log-level", "warn", *prom]
        return cmd
    raise ValueError(f"unknown router kind {kind!r}")


@contextlib.contextmanager
def running_router(
    kind: str,
    policy: str,
    engines: Sequence[EngineHandle],
    cfg: ReplayConfig,
    logdir: Path,
    timeout: float = 90.0,
    settle_s: float = 2.0,
    extra: Sequence[str] = (),
) -> Iterator[tuple[str, list[str]]]:
    """Start a router in front of ``engines``; yields (base URL, command). ``settle_s``
    lets event subscribers connect before traffic (ZMQ drops what a late SUB misses);
    ``extra`` flags go on the router's command line."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        index = "memory"
        if kind == "ours" and "*" in policy:  # workers share through a Redis index
            index = stack.enter_context(private_redis()).url
        cmd = [*router_command(kind, policy, port, engines, cfg, index), *extra]
        name = kind if kind != "ours" else f"ours-{policy.replace('*', 'x')}"
        name = name.replace("/", "_")  # ours-POLICY@CHECKOUT: one log file name
        proc = spawn(name, cmd, logdir)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout)
            time.sleep(settle_s)
            yield f"http://127.0.0.1:{port}", cmd
        finally:
            proc.stop()


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its live descendants, seconds: the scheduler's nanosecond
    run time of each live thread (``/proc/PID/task/TID/schedstat``), where the kernel
    keeps it; else utime + stime, which come in clock ticks (10 ms: at 400 requests a
    cell, 0.025 ms a request -- coarser than the differences a before/after run looks
    for). Threads that ended between two readings are not counted by the first way."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            tasks = list(Path(f"/proc/{p}/task").iterdir())
            try:
                total += sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9
            except (OSError, ValueError, IndexError):
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / _TICKS
            for task in tasks:
                kids = (task / "children").read_text().split()
                todo += [int(k) for k in kids]
    return total


def pid_listening(base: str) -> int | None:
    """The pid of the process listening on ``base``'s port (from /proc/net/tcp)."""
    port = int(base.rsplit(":", 1)[1])
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                parts = line.split()
                if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "0A":
                    inodes.add(parts[9])
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(proc.name)
    return None


def router_pid(base: str) -> int | None:
    """The router process serving ``base``: the one listening there, or, for ``--workers``
    (several listen), their supervisor, whose CPU time counts them all."""
    pid = pid_listening(base)
    if pid is None:
        return None
    with contextlib.suppress(OSError, IndexError, ValueError):
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if b"--workers" in Path(f"/proc/{ppid}/cmdline").read_bytes():
            return ppid
    return pid
