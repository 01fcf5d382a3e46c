"""Where an instance's events come from, and the per-instance feed state ingest keeps."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from events.subscriber import SubscriberItem
from router.ingest.metrics import FeedMetrics
from router.ingest.view import ViewState


@dataclass(frozen=True, slots=True)
class InstanceSource:
    """Where an instance publishes (vLLM's ``endpoint`` / ``replay_endpoint`` / ``topic``)."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool | None = None  # None: the subscriber's rule (bind a wildcard endpoint)


class EventSource(Protocol):
    """What ingest needs of a subscriber (``events.subscriber.ZmqEventSubscriber``)."""

    async def start(self) -> None: ...
    def __aiter__(self) -> AsyncIterator[SubscriberItem]: ...
    async def close(self) -> None: ...


SourceFactory = Callable[[InstanceSource, int | None], EventSource]


@dataclass
class Feed:
    """What ingest keeps per instance: its source, its loop and how far it got."""

    source: InstanceSource
    start_seq: int | None
    metrics: FeedMetrics  # its children of ingest's per-batch series
    task: asyncio.Task[None] | None = None
    sub: EventSource | None = None
    last_seq: int | None = None
    handled: int = 0
    pending_reset: bool = False
    resyncing: bool = False
    synced: bool = False  # the index holds our cursor: a batch was applied since the clear
    stopped: bool = False
    seen_stats: dict[str, int] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    view: ViewState = field(default_factory=ViewState)  # complete or partial, and why
    # ``(ts, seq)`` of the shared index's cursor when the feed started from it: the first
    # replayed batch must be that one, else the engine restarted since (another incarnation).
    anchor: tuple[float, int] | None = None
