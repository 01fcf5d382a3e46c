"""``kvroute up --keep``: prints the dashboard URL, keeps the last round's stack up after the
table (its dashboard shows the workload's requests) until Ctrl-C, then stops every child
and exits 0. Real engine and router processes on loopback, tiny settings."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from kvtest import child_pids

REPO = Path(__file__).resolve().parents[2]
KVROUTE = [sys.executable, "-m", "kvroute_cli.main"]
TINY = ["--engines", "2", "--conversations", "2", "--turns", "2", "--max-tokens", "4"]
TINY += ["--time-scale", "5", "--policies", "cost"]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _drain(q: queue.Queue[str]) -> str:
    out = []
    with contextlib.suppress(queue.Empty):
        while True:
            out.append(q.get_nowait())
    return "".join(out)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_up_keep_serves_the_dashboard_until_ctrl_c():
    env = {**os.environ, "COLUMNS": "200", "TERM": "dumb"}
    proc = subprocess.Popen(
        [*KVROUTE, "up", *TINY, "--keep"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while not any("kept up" in ln for ln in seen):
            assert proc.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=0.5))
        text = "".join(seen)
        # Printed when the round's stack came up, before the workload, and again when kept.
        first = re.search(r"dashboard for cost: (http://127\.0\.0\.1:\d+/dashboard)", text)
        assert first, text
        url = first.group(1)
        assert f"dashboard {url}" in text and "Ctrl-C" in text
        assert re.search(r"^\s*cost\s+\d", text, re.M), text  # the table came first

        children = child_pids(proc.pid)
        assert len(children) == 3, children  # 2 engines + the router, still up
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200
        assert len(re.findall(r'data-k="http://127\.0\.0\.1:\d+"', page.text)) >= 2
        state = httpx.get(f"{url}/state", timeout=10).json()
        assert state["totals"]["requests"].get("ok") == 4  # 2 conversations x 2 turns
        assert len(state["instances"]) == 2

        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=40)
        reader.join(timeout=5)  # the rest of the output, up to EOF
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = text + _drain(lines)
    assert proc.returncode == 0, out
    assert "all 3 child processes stopped" in out, out
    deadline = time.monotonic() + 5
    while [p for p in children if _running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if _running(p)]
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "router port still open"
