"""Session affinity: keep a session on its instance while that costs little.

A session is named by a request header (``session_header``, e.g. ``X-Session-ID``) or,
optionally, the OpenAI ``user`` field. Applied after the policy's ranking, never inside
it: the session's last instance is moved to the front when its predicted TTFT is at most
``max_extra_ttft_s`` above the best candidate's (policies that predict nothing: always,
while it is a candidate). Otherwise the policy's choice stands and the session moves
there. Prefix routing already keeps most multi-turn conversations together; affinity
adds stickiness for what the index cannot see (engine-side state, per-session adapters,
client expectations) at a bounded price.

The table is an LRU of ``max_sessions`` entries, each forgotten ``ttl_s`` after its last
request.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from router.config import SessionSettings
from router.decision.policy import Decision

__all__ = ["AffinityConfig", "SessionAffinity"]


class HeaderLookup(Protocol):
    """What the affinity reads of a request's headers: one by (lower-case) name."""

    def get(self, name: str, default: str | None = None, /) -> str | None: ...


# Its settings (defaults and bounds: ``router.config.SessionSettings``).
AffinityConfig = SessionSettings


class SessionAffinity:
    def __init__(self, config: AffinityConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self._header = (config.header or "").lower()
        self._sessions: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self.outcomes = Counter(
            "kvroute_router_session_affinity",
            "Requests with a session key: kept (on its instance), moved, new.",
            ["outcome"], registry=registry or CollectorRegistry(),
        )  # fmt: skip

    def session_key(self, headers: HeaderLookup, body: Mapping[str, Any]) -> str | None:
        """The request's session: the header if set, else ``user`` when enabled."""
        if self._header:
            value = headers.get(self._header)
            if value:
                return f"h:{value}"
        if self.config.user_field:
            user = body.get("user")
            if isinstance(user, str) and user:
                return f"u:{user}"
        return None

    def _pinned(self, key: str, now: float) -> str | None:
        entry = self._sessions.get(key)
        if entry is None:
            return None
        if now - entry[1] > self.config.ttl_s:
            del self._sessions[key]
            return None
        return entry[0]

    def apply(
        self, decision: Decision, key: str | None, *, record: bool = True
    ) -> tuple[Decision, dict[str, Any] | None]:
        """The decision with the session's instance first when within the bound, and what
        happened (``/debug/route``). ``record``: remember the final choice for the session."""
        if key is None or not decision.ranked:
            return decision, None
        now = time.monotonic()
        pinned = self._pinned(key, now)
        bound = self.config.max_extra_ttft_s
        info: dict[str, Any] = {"pinned": pinned, "bound_s": bound, "extra_ttft_s": None}
        if pinned is None:
            outcome = "new"
        elif pinned not in decision.ranked:
            outcome = "moved"  # down, removed, or not in the request's pool
        else:
            best, mine = decision.breakdown.get(decision.ranked[0]), decision.breakdown.get(pinned)
            extra = mine.ttft_s - best.ttft_s if best is not None and mine is not None else 0.0
            info["extra_ttft_s"] = extra
            if extra <= bound:
                outcome = "kept"
                ranked = [pinned, *(u for u in decision.ranked if u != pinned)]
                decision = replace(decision, instance=pinned, ranked=ranked)
            else:
                outcome = "moved"
        info["outcome"] = outcome
        if record:
            self.outcomes.labels(outcome).inc()
            self._sessions[key] = (decision.instance, now)
            self._sessions.move_to_end(key)
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
        return decision, info
