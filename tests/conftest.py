"""Shared fixtures: the golden vectors in tests/data (scripts/regen-vectors.py writes them
from the real vLLM package and records what made each field; tests/README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    return DATA / "vectors"


@pytest.fixture(scope="session")
def block_hash_vectors(vectors_dir: Path) -> dict:
    return json.loads((vectors_dir / "block_hashes.json").read_text())


@pytest.fixture(scope="session")
def event_batch_vectors(vectors_dir: Path) -> dict:
    return json.loads((vectors_dir / "event_batches.json").read_text())
