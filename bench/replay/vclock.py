"""An asyncio event loop on a virtual clock: sleeping advances time instead of waiting.

The simulator runs the real ``EngineCore`` (its ``asyncio.sleep`` per engine step is the
timing model) and our router's scorer and policy in one loop. With ``time()`` virtual and
a selector that, instead of blocking for ``timeout``, moves the clock forward by it, the
loop jumps from one timer to the next: discrete-event simulation with the same code that
serves HTTP, no re-implementation to drift. Nothing here may wait on real I/O or threads;
if nothing is ready and nothing is scheduled the loop would wait forever, so that raises.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

__all__ = ["VirtualClockLoop", "VirtualDeadlock"]


class VirtualDeadlock(RuntimeError):
    """Every task waits on something no timer will ever bring."""


class _VirtualSelector:
    """Delegates to a real selector (the loop's self-pipe) but never blocks."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise VirtualDeadlock("virtual clock: no task is ready and no timer is pending")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``loop.time()`` starts at 0 and only moves when every task is waiting on a timer."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_VirtualSelector(self))  # type: ignore[arg-type]

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds
