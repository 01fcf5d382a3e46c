"""``KVEventsConfig``: vLLM's KV event publishing settings, same names and defaults.

Kept field-for-field identical to ``vllm/config/kv_events.py`` so that the JSON an
operator passes to ``vllm serve --kv-events-config`` configures our publisher too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["KVEventsConfig"]


@dataclass
class KVEventsConfig:
    """Configuration for KV event publishing (vLLM 0.33 field names and defaults)."""

    enable_kv_cache_events: bool = False
    # "null" | "zmq" (or a name registered with ``events.publisher.register_publisher``).
    # None resolves like vLLM: "zmq" when events are enabled, else "null".
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark
    max_queue_size: int = 100_000  # batches queued before publish() blocks
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"KVEventsConfig.{name} must be a non-negative int, got {value!r}")

    @classmethod
    def from_json(cls, text: str | bytes) -> KVEventsConfig:
        """Parse vLLM's ``--kv-events-config`` JSON; unknown keys are an error, not a typo
        silently falling back to a default."""
        try:
            raw: Any = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ValueError(f"invalid KV events config JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("KV events config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown KV events config keys: {unknown}")
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid KV events config: {exc}") from exc

    def to_json(self) -> str:
        """The config as vLLM's CLI accepts it."""
        return msgspec.json.encode(dataclasses.asdict(self)).decode()
