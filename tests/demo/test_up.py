"""``kvroute up`` end to end: real engine, router (and redis) processes on loopback.

Tiny settings (2 engines, 3 conversations x 3 turns, high time scale) keep each run in
seconds. What is proved: the table is printed with one row per policy and the numbers of
the report; prefix-aware routing reuses KV; every child process is gone afterwards and its
ports are closed -- also when ``kvroute up`` is interrupted mid-run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtest import child_pids

REPO = Path(__file__).resolve().parents[2]
KVROUTE = [sys.executable, "-m", "kvroute_cli.main"]
TINY = ["--engines", "2", "--conversations", "3", "--turns", "3", "--max-tokens", "8"]
TINY += ["--time-scale", "5"]


def _alive(pid: int) -> bool:
    """A process with this pid still runs one of our programs (pid reuse aside)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and (b"kvroute_cli" in cmdline or b"redis-server" in cmdline)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_up_prints_one_row_per_policy_reuses_kv_and_leaves_no_process(tmp_path):
    out = tmp_path / "report.json"
    cmd = [*KVROUTE, "up", *TINY, "--policies", "cost,round_robin", "--out", str(out)]
    env = {**os.environ, "COLUMNS": "120", "TERM": "dumb"}
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["policy"]: r for r in report["rows"]}
    assert list(rows) == ["cost", "round_robin"]

    for name, row in rows.items():
        assert row["requests"] == 9 and row["errors"] == 0, row
        assert len(row["engines"]) == 2
        # Each request names the engine that served it: one of this round's two engines.
        assert {r["instance"] for r in row["records"]} <= set(row["engines"]), name
        assert all(r["ttft_s"] and r["ttft_s"] > 0 for r in row["records"])
        assert sum(row["per_instance"].values()) == 9
    cost = rows["cost"]
    # Later turns of a conversation extend its earlier prompt: the cost policy must reuse.
    assert cost["hit_ratio"] > 0.3, cost
    assert cost["cached_tokens"] == sum(r["cached_tokens"] for r in cost["records"])
    assert cost["prediction_accuracy"] is not None  # the router predicted, we compared
    assert rows["round_robin"]["prediction_accuracy"] is None  # it does not predict

    # The printed table carries the report's numbers.
    text = proc.stdout
    for name, row in rows.items():
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(name)), None)
        assert line is not None, f"no table row for {name}:\n{text}"
        assert f"{row['hit_ratio']:.1%}" in line, line
        assert f"{row['ttft_p50_ms']:.0f} ms" in line, line

    # Every child stopped and every port it listened on is closed.
    assert len(report["pids"]) == 2 * (2 + 1)
    assert _wait_gone(report["pids"]) == []
    ports = [p for row in rows.values() for p in row["ports"]]
    assert ports and not [p for p in ports if _listening(p)]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_interrupted_mid_run_stops_every_child(tmp_path, sig):
    if sig == signal.SIGTERM and shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    # A long workload, so the signal lands while engines and the router are up.
    cmd = [*KVROUTE, "up", "--engines", "2", "--conversations", "4", "--turns", "30"]
    cmd += ["--time-scale", "1", "--gpu-blocks", "4096", "--policies", "cost"]
    if sig == signal.SIGTERM:
        cmd += ["--index", "redis"]  # a private redis-server must be stopped as well
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        want = 2 + 1 + (sig == signal.SIGTERM)
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= child_pids(proc.pid)
            if len(seen) >= want:
                break
            time.sleep(0.2)
        assert len(seen) >= want, f"children seen: {seen}"
        time.sleep(3)  # into the workload
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, output
    assert "interrupted" in output
    assert _wait_gone(sorted(seen)) == [], output


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_up_failure_exits_1_keeps_the_logs_and_stops_every_child(tmp_path):
    # 8 GPU blocks hold no 1.6k-token prompt: the engine refuses it with vLLM's 400.
    cmd = [*KVROUTE, "up", "--engines", "1", "--conversations", "1", "--turns", "1"]
    cmd += ["--gpu-blocks", "8"]
    env = {**os.environ, "COLUMNS": "300", "TERM": "dumb"}
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=80, env=env, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "maximum context length" in output  # the engine's own error reaches the user
    m = re.search(r"\(logs: (\S+)\)", output)
    assert m, output
    log_dir = Path(m.group(1))
    try:
        logs = {p.name: p.read_text() for p in log_dir.glob("*.log")}
        assert set(logs) == {"engine-0-cost.log", "router-cost.log"}
        # Each log starts with its command line: every port named there must be closed.
        ports = [int(p) for text in logs.values() for p in re.findall(r"--port (\d+)", text)]
        assert len(ports) == 2 and not [p for p in ports if _listening(p)]
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
