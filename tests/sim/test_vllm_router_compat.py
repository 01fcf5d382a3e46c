"""Compatibility: the PyPI ``vllm-router`` (Rust, ``--policy kv_aware``) accepts our engines
as workers, routes to them, and ingests their KV events (a repeated prompt is credited)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import zmq
from kvtest import engines, free_port

from stack.procs import EventForwarder

VLLM_ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
DECISION = re.compile(r"KV prefix decision .*?credited_prefix_tokens=(\d+)")


def test_vllm_router_kv_aware_routes_and_credits_our_events(tmp_path):
    assert Path(VLLM_ROUTER).exists(), "vllm-router is a dev dependency; pip install -e '.[dev]'"
    # vllm-router reads tcp:// sources only: the engines publish through loopback relays.
    ctx = zmq.Context()
    relays = [EventForwarder(ctx) for _ in range(2)]
    try:
        _route_and_credit(tmp_path, relays)
    finally:
        for r in relays:
            r.close()
        ctx.term()


def _route_and_credit(tmp_path: Path, relays: list[EventForwarder]) -> None:
    args = ("--profile", "full", "--time-scale", "50")
    with engines(tmp_path, 2, *args, forwarders=relays) as (a, b):
        port = free_port()
        cmd = [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware"]
        cmd += ["--worker-urls", a.url, b.url, "--kv-event-model", "kvroute-sim"]
        cmd += ["--kv-event-block-size", "16", "--log-level", "debug"]
        cmd += ["--health-check-interval-secs", "1", "--prometheus-host", "127.0.0.1"]
        cmd += ["--prometheus-port", str(free_port())]
        for e in (a, b):
            cmd += ["--kv-event-source", f"{e.url}={e.events}"]
            cmd += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
        log = tmp_path / "vllm-router.log"
        with log.open("wb") as fh:
            router = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}/v1/completions"
            prompt = "vllm-router compatibility check with a repeated prompt. " * 12
            body = {"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}
            deadline = time.monotonic() + 60
            served: list[dict] = []
            while time.monotonic() < deadline and len(served) < 4:
                try:
                    r = httpx.post(url, json=body, timeout=10)
                except httpx.HTTPError:
                    r = None
                if r is not None and r.status_code == 200:
                    served.append(r.json())
                time.sleep(0.5)  # let the engine's events reach the router
            assert len(served) == 4, log.read_text()[-3000:]
            engines_used = {s["system_fingerprint"] for s in served}
            assert engines_used <= {f"kvroute-engine:127.0.0.1:{e.port}" for e in (a, b)}
            # Our engine reports the hit it really had, and the router credited one too.
            assert served[-1]["usage"]["kv_hit"]["gpu_tokens"] > 0
            text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
            credited = [int(m) for m in DECISION.findall(text)]
            assert credited and max(credited) > 0, text[-3000:]
        finally:
            router.terminate()
            router.wait(10)
