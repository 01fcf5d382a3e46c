"""Shared fixtures: the golden vectors in tests/data (scripts/regen-vectors.py writes them
from the real vLLM package and records what made each field; tests/README.md)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"

# A suite started in the background by a non-interactive shell (`make test &`, nohup, some
# CI runners) inherits SIGINT ignored, and so would every child it starts: a Python child
# then never raises KeyboardInterrupt, and the tests that press Ctrl-C on `kvroute up` or
# `kvroute events tail` (an operator's foreground process, where SIGINT is never ignored)
# would wait for an exit that cannot come. A handler here is reset to the default at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    return DATA / "vectors"


@pytest.fixture(scope="session")
def block_hash_vectors(vectors_dir: Path) -> dict:
    return json.loads((vectors_dir / "block_hashes.json").read_text())


@pytest.fixture(scope="session")
def event_batch_vectors(vectors_dir: Path) -> dict:
    return json.loads((vectors_dir / "event_batches.json").read_text())
