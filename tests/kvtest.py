"""Test kit shared across test packages: real engines, routers and Redis on loopback.

A thin layer over ``stack.procs`` (the one supervisor the demo, the chaos scenarios and the
benchmarks use too): the tests here start processes per test and stop them themselves.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from stack.procs import EventForwarder, Fleet, Proc, child_pids, free_port

__all__ = [
    "EventForwarder",
    "Proc",
    "child_pids",
    "debug_route",
    "engines",
    "free_port",
    "send_turns",
    "start_engine",
    "start_redis",
    "start_router",
    "wait_until",
]


def start_engine(
    tmp: Path,
    *args: str,
    port: int | None = None,
    replay_port: int | None = None,
    forwarder: EventForwarder | None = None,
    wait: bool = True,
) -> Proc:
    """One ``kvroute engine``; the caller stops it (``Proc.stop`` returns its exit code)."""
    return Fleet(tmp).engine(
        *args, wait=wait, port=port, replay_port=replay_port, forwarder=forwarder, quiet=False
    )


@contextlib.contextmanager
def engines(
    tmp: Path, count: int, *args: str, forwarders: Sequence[EventForwarder] | None = None
) -> Iterator[list[Proc]]:
    """``count`` engines started side by side (their imports overlap), stopped at the end."""
    with Fleet(tmp) as fleet:
        procs = [
            fleet.engine(
                *args, wait=False, forwarder=forwarders[i] if forwarders else None, quiet=False
            )
            for i in range(count)
        ]
        yield [p.wait_ready() for p in procs]


def start_router(
    tmp: Path, engines_: list[Proc], *args: str, env: dict[str, str] | None = None
) -> Proc:
    """A ``kvroute router`` over ``engines_``; the caller stops it."""
    return Fleet(tmp).router(engines_, *args, env=env, quiet=False)


def start_redis(port: int | None = None) -> tuple[subprocess.Popen, int]:
    """A private redis-server on loopback (persistence off); the caller kills it."""
    import tempfile

    p = Fleet(Path(tempfile.mkdtemp(prefix="kvr-redis-"))).redis(port)
    assert p.proc is not None
    return p.proc, p.port


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


def wait_until(cond: Callable[[], object], timeout: float = 20.0, what: str = "condition"):
    """Poll ``cond()`` until it returns something truthy; return that (or fail naming
    ``what``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := cond():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def debug_route(router: Proc, body: dict, headers: dict | None = None) -> dict:
    """The router's ``/debug/route`` answer for an OpenAI body (asserting a 200)."""
    import httpx

    r = httpx.post(f"{router.url}/debug/route", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()
