"""``kvroute router --workers N``: N router processes on one port, each a replica.

The kernel spreads connections over the N listening sockets (``SO_REUSEPORT``), so each
worker is a full router -- its own event loop, decisions and forwards -- and they act as
one the way replicas do (``router.prediction.shared``): through the Redis index, which
holds the residency, and its channel, which carries each worker's predict-on-route
records and in-flight load. Hence N > 1 needs a Redis index: with the memory index each
worker would hold an index of its own, ingest every event N times and see none of the
others' requests. Ingest stays once per fleet: worker 0 ingests, the others read the
shared index (and take its applied batches from the channel: their settled records give
way then, as worker 0's do).

The parent only supervises: it resolves the port (0: a free one, the same for all), starts
the workers (``spawn``: no event loop or socket is inherited), forwards SIGTERM/SIGINT,
and stops them all when one dies, exiting with its code. A worker dies with its parent.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import signal
import socket
import sys
from typing import Any

from router.config import RouterSettings

__all__ = ["check_workers", "reuseport_socket", "serve_workers"]

log = logging.getLogger(__name__)


def check_workers(settings: RouterSettings) -> None:
    """Refuse ``workers > 1`` without a Redis index (ValueError naming the fix)."""
    if settings.workers > 1 and not settings.index.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"--workers {settings.workers} needs a Redis index (--index redis://...): the "
            "workers share residency, predictions and in-flight load through it"
        )


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not yet listening)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _worker(fields: dict[str, Any], rank: int) -> None:
    _die_with_parent()
    from router.http.server import serve

    settings = RouterSettings(**fields)
    if rank > 0:
        settings = settings.model_copy(update={"ingest": False})
    logging.basicConfig(level=settings.log_level.upper(), format=f"[worker {rank}] %(message)s")
    sock = reuseport_socket(settings.host, settings.port)
    serve(settings, sock=sock)


def serve_workers(settings: RouterSettings) -> None:
    """Run ``settings.workers`` router processes on one port until stopped."""
    check_workers(settings)
    probe = reuseport_socket(settings.host, settings.port)  # resolves port 0 for all
    port = probe.getsockname()[1]
    fields = settings.model_copy(update={"port": port, "workers": 1}).model_dump()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(fields, rank), name=f"kvroute-worker-{rank}")
        for rank in range(settings.workers)
    ]
    for p in procs:
        p.start()
    probe.close()
    log.info("router: %d workers on %s:%d", len(procs), settings.host, port)

    def stop(*_: object) -> None:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    try:
        multiprocessing.connection.wait([p.sentinel for p in procs])
        code = next((p.exitcode for p in procs if p.exitcode is not None), 0) or 0
    finally:
        stop()
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
    sys.exit(code if code >= 0 else 0)
