"""Guards against impossible events and batches (dropped and counted, never applied)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

# Far above any model's KV cache group count; bounds what one event can make us allocate
# (the layout has a spec per group index up to the largest seen).
MAX_GROUPS = 1024
# A batch stamped this far ahead of our clock is corrupt (vLLM stamps time.time()): its
# (ts, seq) would become the index cursor and make every real batch until then look stale.
MAX_CLOCK_AHEAD_S = 3600.0


def plausible_ts(ts: float) -> bool:
    return math.isfinite(ts) and ts < time.time() + MAX_CLOCK_AHEAD_S


def _impossible_group(g: int | None) -> bool:
    return g is not None and not 0 <= g < MAX_GROUPS


def impossible(ev: object) -> bool:
    return _impossible_group(getattr(ev, "group_idx", None))


def any_impossible(events: Sequence[object]) -> bool:
    """``any(map(impossible, events))`` over the batch's few distinct group indices (one
    pass without a call per event: a busy engine's batch holds dozens)."""
    return any(map(_impossible_group, {getattr(ev, "group_idx", None) for ev in events}))
