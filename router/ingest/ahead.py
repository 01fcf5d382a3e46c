"""Read an event source ahead of ingest, so what arrives while one chunk is being applied
is ready as the next chunk (one index round trip for a backlog, not one per batch)."""

from __future__ import annotations

import asyncio

from events.subscriber import SubscriberItem
from router.ingest.sources import EventSource


class _End:
    """Queued after the last item: the source ended (``error`` None) or failed."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error


class ReadAhead:
    """Iterates ``source`` in a task into a bounded queue (``depth`` items; the source's
    own buffers hold the rest). Order is the source's; its error comes after the items
    read before it."""

    def __init__(self, source: EventSource, depth: int = 1024) -> None:
        self._queue: asyncio.Queue[SubscriberItem | _End] = asyncio.Queue(depth)
        self._end: _End | None = None
        self._task = asyncio.get_running_loop().create_task(self._read(source))

    async def _read(self, source: EventSource) -> None:
        try:
            async for item in source:
                await self._queue.put(item)
        except Exception as exc:  # handed to the consumer, in order
            await self._queue.put(_End(exc))
        else:
            await self._queue.put(_End())

    async def next(self, limit: int) -> list[SubscriberItem]:
        """Up to ``limit`` items: waits for the first, takes the rest only if already
        queued. ``[]`` once the source has ended; raises its error instead if it failed."""
        out: list[SubscriberItem] = []
        if self._end is None:
            item = await self._queue.get()
            while True:
                if isinstance(item, _End):
                    self._end = item
                    break
                out.append(item)
                if len(out) >= limit or self._queue.empty():
                    break
                item = self._queue.get_nowait()
        if out:
            return out
        assert self._end is not None
        if self._end.error is not None:
            raise self._end.error
        return []

    async def close(self) -> None:
        """Stop reading (the caller closes the source)."""
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=1.0)
