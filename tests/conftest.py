"""Shared fixtures: paths to the golden vectors and traces in ../shared."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVROUTE_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    path = SHARED / "vectors"
    assert path.is_dir(), f"golden vectors not found at {path} (set KVROUTE_SHARED)"
    return path


@pytest.fixture(scope="session")
def block_hash_vectors(vectors_dir: Path) -> dict:
    return json.loads((vectors_dir / "block_hashes.json").read_text())


@pytest.fixture(scope="session")
def event_batch_vectors(vectors_dir: Path) -> dict:
    return json.loads((vectors_dir / "event_batches.json").read_text())
