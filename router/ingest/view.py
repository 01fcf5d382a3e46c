"""Whether the router's view of one instance is complete or partial.

vLLM numbers an engine's batches from 0 per process and keeps the last ``buffer_steps``
of them for replay. A router that rebuilds an instance (started after its engine, or
after a gap it had to clear) asks for seq 0 on: if the replay's first batch is seq 0, it
has seen everything since the engine started and its view is **complete**; if the
buffer no longer reaches back that far (the first replayed seq > 0: batches before it are
gone), the blocks those batches stored and never evicted are unknown -- the view is
**partial** and predictions can only be too low for them, never too high. A publisher
restart empties the engine's cache: the view is complete again from the new seq 0.

The state moves only on what ingest applies, in order, so ``/debug/route`` and the
dashboard read it without locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["ViewState"]

View = Literal["waiting", "complete", "partial"]


@dataclass(slots=True)
class ViewState:
    """One instance's view: ``waiting`` (nothing applied since the last rebuild began),
    ``complete`` or ``partial``; ``lost`` is the seq range the partial view lacks."""

    state: View = "waiting"
    expect: int | None = 0  # the seq a gapless view applies next; None: anything
    lost: tuple[int, int] | None = None
    origin: str = "replay"  # how the current view began: replay, live, index, restart
    since: float = field(default_factory=time.time)

    def rebuild(self, expect: int | None, origin: str) -> None:
        """A rebuild starts (the instance was cleared, or is new): from ``expect`` on."""
        self.state, self.expect, self.lost, self.origin = "waiting", expect, None, origin
        self.since = time.time()

    def kept(self, seq: int) -> None:
        """A shared index already holds the instance up to ``seq`` (ingested by replicas
        that kept running): the view is theirs, exact at once, continued from ``seq + 1``."""
        self.state, self.expect, self.lost, self.origin = "complete", seq + 1, None, "index"
        self.since = time.time()

    def cleared(self) -> None:
        """The instance was cleared with no replay to rebuild from: whatever it cached
        before is unknown from now on."""
        self.rebuild(None, "live")
        self.state = "partial"

    def missed(self, first: int, last: int) -> None:
        """Batches ``first .. last`` are gone (not in the replay buffer any more)."""
        self.state = "partial"
        self.lost = (first, last) if self.lost is None else (min(self.lost[0], first), last)
        self.expect = last + 1

    def applied(self, seq: int) -> None:
        """Batch ``seq`` was applied: the first one decides a waiting view."""
        if self.expect is not None and seq > self.expect:
            self.missed(self.expect, seq - 1)  # joined late (no replay): never seen
        elif self.state == "waiting":
            self.state = "complete" if self.expect is not None else "partial"
        self.expect = seq + 1

    def describe(self) -> dict[str, Any]:
        return {
            "view": self.state,
            "origin": self.origin,
            "lost_seqs": list(self.lost) if self.lost else None,
            "since": self.since,
        }
