"""Give the heap back to the operating system after a large backlog was applied.

Applying a backlog allocates and frees a lot (wire payloads, decoded batches, index
growth); glibc keeps freed memory in its arenas, so a router that met a fleet's backlog
kept that peak as its resident size. ``malloc_trim(0)`` returns the free pages. It walks
the heap (milliseconds for a gigabyte), so it runs only when a feed has caught up with its
source after at least ``min_blocks`` block events since the last trim, and at most every
``min_interval_s``. Where glibc is absent it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger("router.ingest")


def _malloc_trim() -> Callable[[], object] | None:
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
        return lambda: trim(0)
    return None


class HeapTrimmer:
    def __init__(self, min_blocks: int = 500_000, min_interval_s: float = 5.0) -> None:
        self.min_blocks = min_blocks
        self.min_interval_s = min_interval_s
        self.trims = 0
        self._since = 0  # block events applied since the last trim
        self._last = float("-inf")
        self._trim = _malloc_trim()

    def applied(self, blocks: int) -> None:
        self._since += blocks

    def caught_up(self) -> None:
        """A feed has nothing left read ahead: trim if enough was applied since the last."""
        if self._since < self.min_blocks or self._trim is None:
            return
        now = time.monotonic()
        if now - self._last < self.min_interval_s:
            return
        self._last, self._since = now, 0
        self._trim()
        self.trims += 1
        log.debug("heap trimmed after a backlog")
