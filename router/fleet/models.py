"""Which instances serve which model: a request's ``model`` picks its pool.

Each instance's ``GET /v1/models`` is read at every successful health probe, so the pools
follow engines that are restarted with other models or load adapters. vLLM lists its
served model names, and each LoRA adapter as a card whose ``parent`` is the base model and
whose ``root`` is the adapter's path (``OpenAIServingModels.show_available_models``).
A model declared for an instance (``URL=...,model=NAME``) overrides what it lists.

Routing only looks at the pool's instances, so the index and the speculative residency,
both per instance, are namespaced per model with no extra state: an instance of another
model is never a candidate. A request naming no model goes anywhere (vLLM then serves its
default model). An instance whose list is unknown (its ``/v1/models`` unreadable) stays a
candidate for any model: the engine answers for itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.fleet.instances import Instance
from router.http.upstream import UpstreamError

__all__ = ["ModelRegistry", "ServedModels"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServedModels:
    """One instance's models: base names, and LoRA adapters as name -> (parent, path)."""

    bases: frozenset[str] = frozenset()
    adapters: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    cards: tuple[dict[str, Any], ...] = ()

    def serves(self, model: str) -> bool:
        return model in self.bases or model in self.adapters

    @classmethod
    def from_cards(cls, cards: Sequence[Any]) -> ServedModels:
        bases: set[str] = set()
        adapters: dict[str, tuple[str, str | None]] = {}
        kept = []
        for card in cards:
            if not isinstance(card, dict) or not isinstance(card.get("id"), str):
                continue
            kept.append(card)
            parent = card.get("parent")
            if isinstance(parent, str) and parent and parent != card["id"]:
                root = card.get("root")
                adapters[card["id"]] = (parent, root if isinstance(root, str) else None)
            else:
                bases.add(card["id"])
        return cls(frozenset(bases), adapters, tuple(kept))


class ModelRegistry:
    """Per instance URL: what it serves (learned, or declared), for pools and ``/v1/models``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        timeout_s: float = 2.0,
        fetch: Callable[[Instance, str], Awaitable[tuple[int, bytes]]] | None = None,
    ) -> None:
        """``fetch(inst, path) -> (status, body)``: how ``/v1/models`` is read (the
        health prober's client, ``InstanceRegistry.fetch``); default ``client``."""
        self._client = client
        self.timeout_s = timeout_s
        self._fetch = fetch
        self._learned: dict[str, ServedModels] = {}
        self._declared: dict[str, frozenset[str]] = {}

    def declare(self, url: str, models: Sequence[str]) -> None:
        if models:
            self._declared[url] = frozenset(models)

    def forget(self, url: str) -> None:
        self._learned.pop(url, None)
        self._declared.pop(url, None)

    async def refresh(self, inst: Instance) -> None:
        """Read ``inst``'s ``/v1/models``; an unreadable answer keeps what was known."""
        try:
            if self._fetch is not None:
                status, body = await self._fetch(inst, "/v1/models")
            else:
                r = await self._client.get(f"{inst.http_url}/v1/models", timeout=self.timeout_s)
                status, body = r.status_code, r.content
            data = json.loads(body).get("data") if status == 200 else None
        except (httpx.HTTPError, UpstreamError, OSError, ValueError, AttributeError):
            return
        if not isinstance(data, list):
            return
        served = ServedModels.from_cards(data)
        old = self._learned.get(inst.url)
        if old is None or (old.bases, old.adapters) != (served.bases, served.adapters):
            log.info(
                "instance %s serves %s, adapters %s",
                inst.url,
                sorted(served.bases),
                sorted(served.adapters),
            )
        self._learned[inst.url] = served

    def served(self, url: str) -> ServedModels | None:
        """What ``url`` serves; None while unknown. A declaration replaces the base names."""
        learned = self._learned.get(url)
        declared = self._declared.get(url)
        if declared is None:
            return learned
        learned = learned or ServedModels()
        cards = tuple(c for c in learned.cards if c["id"] in learned.adapters)
        return ServedModels(declared, learned.adapters, cards)

    def pool(
        self, model: Any, healthy: Sequence[Instance], every: Sequence[Instance]
    ) -> list[Instance] | None:
        """The healthy instances that may serve ``model``; None if no instance serves it
        (vLLM's 404); an empty list if only unhealthy ones do (503)."""
        if not isinstance(model, str) or not model:
            return list(healthy)
        pool = [i for i in healthy if (s := self.served(i.url)) is None or s.serves(model)]
        if pool:
            return pool
        if any((s := self.served(i.url)) is None or s.serves(model) for i in every):
            return []
        return None

    def adapter(self, model: Any, pool: Sequence[Instance]) -> tuple[str, str | None] | None:
        """``(lora_name, lora_path)`` when ``model`` is a LoRA adapter of the pool."""
        if not isinstance(model, str):
            return None
        for inst in pool:
            s = self.served(inst.url)
            if s is not None and model in s.adapters:
                return model, s.adapters[model][1]
        return None

    def cards(self, instances: Sequence[Instance]) -> list[dict[str, Any]]:
        """``/v1/models`` of the fleet: every card once (first instance's wins)."""
        seen: dict[str, dict[str, Any]] = {}
        for inst in instances:
            s = self.served(inst.url)
            if s is None:
                continue
            for card in s.cards:
                seen.setdefault(card["id"], card)
            for name in s.bases:
                seen.setdefault(name, {"id": name, "object": "model", "owned_by": "kvroute"})
        return list(seen.values())

    def describe(self, url: str) -> dict[str, Any] | None:
        s = self.served(url)
        if s is None:
            return None
        return {"models": sorted(s.bases), "adapters": sorted(s.adapters)}
