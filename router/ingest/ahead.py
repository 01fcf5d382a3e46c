"""Read an event source ahead of ingest, so what arrives while one chunk is being applied
is ready as the next chunk (one index round trip for a backlog, not one per batch)."""

from __future__ import annotations

import asyncio

from events.subscriber import BatchReceived, SubscriberItem
from router.ingest.sources import EventSource


class _End:
    """Queued after the last item: the source ended (``error`` None) or failed."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error


def _blocks(item: SubscriberItem) -> int:
    if type(item) is not BatchReceived:
        return 0
    return sum([len(getattr(ev, "block_hashes", ())) for ev in item.batch.events])


class ReadAhead:
    """Iterates ``source`` in a task into a bounded queue: at most ``depth`` items and
    ``max_blocks`` block hashes decoded ahead (one item past the block bound, so a batch
    larger than the bound still passes). The rest of a backlog waits in the source, in
    wire form: a fleet's backlog decoded at once was most of a cold router's peak memory.
    Order is the source's; its error comes after the items read before it."""

    def __init__(self, source: EventSource, depth: int = 1024, max_blocks: int = 32_768) -> None:
        self._queue: asyncio.Queue[tuple[SubscriberItem | _End, int]] = asyncio.Queue(depth)
        self._end: _End | None = None
        self.max_blocks = max_blocks
        self._blocks = 0  # block hashes queued
        self._room = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._read(source))

    async def _put(self, item: SubscriberItem | _End, blocks: int) -> None:
        while self._blocks >= self.max_blocks:
            self._room.clear()
            await self._room.wait()
        self._blocks += blocks
        await self._queue.put((item, blocks))

    async def _read(self, source: EventSource) -> None:
        try:
            async for item in source:
                await self._put(item, _blocks(item))
        except Exception as exc:  # handed to the consumer, in order
            await self._queue.put((_End(exc), 0))
        else:
            await self._queue.put((_End(), 0))

    def _took(self, blocks: int) -> None:
        self._blocks -= blocks
        if self._blocks < self.max_blocks:
            self._room.set()

    async def next(self, limit: int) -> list[SubscriberItem]:
        """Up to ``limit`` items: waits for the first, takes the rest only if already
        queued. ``[]`` once the source has ended; raises its error instead if it failed."""
        out: list[SubscriberItem] = []
        if self._end is None:
            item, blocks = await self._queue.get()
            while True:
                self._took(blocks)
                if isinstance(item, _End):
                    self._end = item
                    break
                out.append(item)
                if len(out) >= limit or self._queue.empty():
                    break
                item, blocks = self._queue.get_nowait()
        if out:
            return out
        assert self._end is not None
        if self._end.error is not None:
            raise self._end.error
        return []

    def empty(self) -> bool:
        """Nothing read ahead: the consumer has caught up with what arrived."""
        return self._queue.empty()

    async def close(self) -> None:
        """Stop reading (the caller closes the source)."""
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=1.0)
