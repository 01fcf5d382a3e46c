"""Fixtures for transport tests; the helpers they use live in ``tests/eventskit.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from eventskit import free_port


@pytest.fixture
def ports() -> Iterator[tuple[int, int]]:
    """(live port, replay port), each with its +1 neighbour free for DP rank 1."""
    yield free_port(2), free_port(2)
