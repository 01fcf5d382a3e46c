"""Reliability and security suite: faults, fuzzing, load (issue #8).

The scenarios live in ``stack/chaos/`` (``kvroute bench chaos`` runs them at full size);
these tests run them small and assert on what they observed. Every process binds loopback:
engines publish on ``ipc://`` sockets, replay and HTTP on 127.0.0.1.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from stack.chaos import Fleet, Proc, start_engines


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Processes started by the test; all stopped at the end (logs stay in tmp_path)."""
    with Fleet(tmp_path) as f:
        yield f


@dataclass
class Edge:
    """One engine and one router, started with default binds (no --host)."""

    fleet: Fleet
    engine: Proc
    router: Proc
    token: str
    router_body_limit: int


@pytest.fixture(scope="session")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    token = uuid.uuid4().hex
    limit = 1 << 20
    with Fleet(tmp_path_factory.mktemp("edge")) as f:
        (engine,) = start_engines(
            f, 1, "--profile", "full", "--time-scale", "50", "--max-model-len", "1024"
        )
        env = {"KVROUTE_ADMIN_TOKEN": token, "KVROUTE_MAX_BODY_BYTES": str(limit)}
        router = f.router([engine], env=env)
        yield Edge(f, engine, router, token, limit)
