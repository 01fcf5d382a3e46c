"""``kvroute bench overhead``'s in-process decision timing (the HTTP part is exercised by
the live smoke test's harness)."""

from __future__ import annotations

import math

from bench.replay.overhead import decision_time, overhead_markdown


def test_decision_time_measures_decide_and_score_choose():
    out = decision_time(instances=(2, 4), tokens=2048, repeats=5)
    assert set(out) == {"2 instances", "4 instances"}
    for row in out.values():
        for step in ("decide", "score+choose"):
            p50, p99 = row[step]["p50_ms"], row[step]["p99_ms"]
            assert 0 < p50 <= p99 and math.isfinite(p99)
    report = {
        "machine": {"argv": ["kvroute", "bench", "overhead"], "processor": "x", "cpus": 2,
                    "platform": "p", "time": "t"},
        "decision_time": out,
        "proxy": {"minimal": {"x1": {
            "direct": {"n": 10, "p50_ms": 1.0, "p99_ms": 2.0},
            "ours:cost": {"n": 10, "p50_ms": 2.5, "p99_ms": 4.0, "added_p50_ms": 1.5,
                          "added_p99_ms": 2.0, "cpu_ms_per_request": 0.4}},
            "stages_ms": {"ours:cost": {"parse": 0.012, "hash": 0.1}}}},
    }  # fmt: skip
    md = overhead_markdown(report)
    assert "| minimal | x1 | ours:cost | 2.50 | 4.00 | 1.50 | 2.00 | 0.40 |" in md
    assert "| minimal | x1 | direct | 1.00 | 2.00 | - | - | - |" in md
    assert "| upstream | router | parse | hash |" in md
    assert "| minimal | ours:cost | 0.012 | 0.100 |" in md
    assert "| 4 instances | decide |" in md


def test_python_floor_relays_answers_byte_for_byte(tmp_path):
    """The yardstick must be a real proxy, or its figures say nothing: whole answers keep
    their body, streamed ones arrive chunk for chunk, an unreachable upstream is a 502."""
    import httpx

    from bench.replay.interleave import _floor, _minimal_upstream
    from stack.procs import free_port

    with _minimal_upstream(tmp_path) as (url, _), _floor(url, tmp_path) as floor:
        for body in ({"prompt": "hi"}, {"prompt": "hi", "stream": True}):
            direct = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
            relayed = httpx.post(f"{floor}/v1/completions", json=body, timeout=10)
            assert relayed.status_code == direct.status_code == 200
            assert relayed.content == direct.content
            assert relayed.headers["content-type"] == direct.headers["content-type"]
        streamed = httpx.post(f"{floor}/v1/completions", json=body, timeout=10)
        assert streamed.headers.get("transfer-encoding") == "chunked"
        assert streamed.text.endswith("data: [DONE]\n\n")
    with _floor(f"http://127.0.0.1:{free_port()}", tmp_path) as floor:
        r = httpx.post(f"{floor}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 502 and b"refused" in r.content


class _Child:
    """A Python child driven line by line: ``step()`` sends a line and returns the next
    line it prints; leaving closes its stdin (every read then returns) and waits for it."""

    def __init__(self, code: str) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def step(self) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self.line()

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def test_cpu_seconds_counts_a_busy_child_finer_than_a_clock_tick():
    """The overhead benchmark's CPU per request: a child that burns 30 ms of CPU between
    two readings is counted as that, at the scheduler's resolution, not in 10 ms clock
    ticks (which made 400 requests' CPU come in steps of 0.025 ms a request)."""
    from bench.replay.procs import cpu_seconds

    code = (
        "import sys, time\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "t = time.thread_time()\n"
        "while time.thread_time() - t < 0.03: pass\n"
        "print('done', flush=True); sys.stdin.readline()\n"
    )
    with _Child(code) as child:
        assert child.line() == "ready\n"
        before = cpu_seconds(child.pid)
        assert child.step() == "done\n"
        spent = cpu_seconds(child.pid) - before
        assert 0.03 <= spent < 0.045, spent
        ticks = spent * 100
        assert abs(ticks - round(ticks)) > 1e-6, f"{spent} s: whole clock ticks"


def test_the_next_batch_waits_until_every_router_is_idle():
    """``_settled`` returns while a router still works off the last batch only at its
    limit, and at once when every router is idle: a child that burns CPU until told to
    stop holds it until then (bounded), an idle one not at all."""
    import asyncio
    import time

    from bench.replay.interleave import _settled, _Target

    code = (
        "import sys, threading\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()\n"
        "print('busy', flush=True)\n"
        "while not stop.is_set(): pass\n"
        "print('idle', flush=True); sys.stdin.readline()\n"
    )
    with _Child(code) as child:
        target = _Target("router", "http://unused", child.pid)
        assert child.line() == "busy\n"
        t0 = time.perf_counter()
        asyncio.run(_settled([target], limit_s=0.3))
        assert time.perf_counter() - t0 >= 0.3  # busy throughout: held to the limit
        assert child.step() == "idle\n"
        t0 = time.perf_counter()
        asyncio.run(_settled([target], limit_s=5.0))
        assert time.perf_counter() - t0 < 2.0  # idle: back after an interval or two
