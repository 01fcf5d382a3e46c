"""CPU offload tier: pinned host chunks, LRU/ARC eviction, async copies, CPU events."""

from engine_adapter.offload.manager import OffloadConfig, OffloadManager

__all__ = ["OffloadConfig", "OffloadManager"]
