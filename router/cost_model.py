"""Per-instance state of the cost policy: the remaining prefill work and the TTFT fit.

Two things the router cannot read from an engine but can learn cheaply:

* ``Backlog``: router-dispatched uncached prompt tokens still to prefill. Work is added
  when the router's in-flight count grows (dispatch), drains at the instance's fitted
  prefill rate as time passes (the engine works through it), and is capped by what is
  still in flight (a first byte retires a request's work). Without the drain, one request
  in flight on a conversation's holder looked as costly a second later as at dispatch.
* ``TtftFit``: observed TTFT ~= ``fixed_s + scale * work_s + per_request_s * requests``
  per instance, fitted by exponentially weighted least squares on the features of the
  prediction made *at decision time* (``Breakdown.raw_s``, ``Breakdown.requests``). The
  fixed term (HTTP, tokenization, step overhead), the compute rate and the wait per
  request already on the instance (admission behind running streams when KV memory is
  full, decode steps interleaved) are different things: one multiplicative factor over
  all of them mispredicts small prompts when it fits large ones, and misses an engine
  that is memory-bound rather than compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

__all__ = ["Backlog", "TtftFit"]


@dataclass(slots=True)
class Backlog:
    tokens: float = 0.0  # remaining prefill work, in uncached prompt tokens
    seen_inflight: int = 0  # router in-flight tokens at the last update
    t: float | None = None

    def update(self, now: float, inflight_tokens: int, tokens_per_s: float) -> float:
        """The remaining work as of ``now`` given the router's in-flight tokens."""
        if self.t is not None and now > self.t:
            self.tokens = max(0.0, self.tokens - (now - self.t) * tokens_per_s)
        self.t = now
        if inflight_tokens > self.seen_inflight:  # dispatched since the last look
            self.tokens += inflight_tokens - self.seen_inflight
        self.seen_inflight = inflight_tokens
        self.tokens = min(self.tokens, float(inflight_tokens))  # first bytes retire work
        return self.tokens


def _solve(a: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (the first largest pivot) of the
    augmented matrix ``a`` (rows ``[*coefficients, value]``, changed in place); None when
    singular. Plain loops: it runs up to three times per observed response."""
    n = len(a)
    for c in range(n):
        p, best = c, abs(a[c][c])
        for r in range(c + 1, n):
            x = abs(a[r][c])
            if x > best:
                p, best = r, x
        if best < 1e-12:
            return None
        a[c], a[p] = a[p], a[c]
        pivot_row = a[c]
        pivot = pivot_row[c]
        for r in range(n):
            if r != c:
                row = a[r]
                f = row[c] / pivot
                for k in range(c, n + 1):
                    row[k] -= f * pivot_row[k]
    return [a[i][n] / a[i][i] for i in range(n)]


# The terms tried, most first: (indices into x, a getter of those columns of a row).
_TERMS = tuple((idx, itemgetter(*idx)) for idx in ((0, 1, 2), (1, 2), (0, 1)))


@dataclass(slots=True)
class TtftFit:
    """Weighted least squares of observed TTFT on (1, work, requests), forgetting old
    points by ``decay`` per observation (about ``1 / (1 - decay)`` points of memory).
    Implausible solutions (a negative coefficient) fall back to fewer terms, down to a
    plain ratio of observed to predicted."""

    decay: float = 0.95
    n: float = 0.0
    # decayed sums of x x^T and x y for x = (1, work_s, requests)
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)
    fixed_s: float = 0.0
    scale: float = 1.0
    per_request_s: float = 0.0

    def add(self, work_s: float, observed_s: float, requests: float = 0.0) -> None:
        if work_s <= 0 or observed_s <= 0:
            return
        observed_s = min(max(observed_s, work_s * 1e-4), work_s * 1e4)  # bound an outlier
        d = self.decay
        x = (1.0, work_s, float(requests))
        self.n = self.n * d + 1
        self.xy = [s * d + xi * observed_s for s, xi in zip(self.xy, x, strict=True)]
        self.xx = [
            [r * d + xi * xj for r, xj in zip(row, x, strict=True)]
            for row, xi in zip(self.xx, x, strict=True)
        ]
        self._fit()

    def added(self, work_s: float, observed_s: float, requests: float = 0.0) -> TtftFit:
        """A copy with one more point (``add``); this fit stays as it was, for the
        decisions that were made with it and read their predictions later."""
        # The sums are shared, not copied: ``add`` builds new lists, never changes these.
        new = TtftFit(
            self.decay, self.n, self.xx, self.xy, self.fixed_s, self.scale, self.per_request_s
        )
        new.add(work_s, observed_s, requests)
        return new

    def _fit(self) -> None:
        xx, xy = self.xx, self.xy
        fixed, scale, per = 0.0, xy[1] / xx[1][1] if xx[1][1] else 1.0, 0.0  # ratio
        # xx[0][1] = sum of work, xy[0] = sum of observed: the ratio of sums is steadier
        if xx[0][1] > 0:
            scale = xy[0] / xx[0][1]
        if self.n >= 6:
            for idx, pick in _TERMS:
                sol = _solve([[*pick(xx[i]), xy[i]] for i in idx])
                if sol is None or min(sol) < 0:
                    continue
                coef = dict(zip(idx, sol, strict=True))
                if coef.get(1, 0.0) <= 0:
                    continue
                fixed, scale, per = coef.get(0, 0.0), coef[1], coef.get(2, 0.0)
                break
        self.fixed_s, self.scale = fixed, min(max(scale, 1e-4), 1e4)
        self.per_request_s = per

    def blended(self, prior: TtftFit, strength: float = 5.0) -> tuple[float, float, float]:
        """``(fixed_s, scale, per_request_s)`` shrunk toward ``prior`` (the fleet's fit)
        while this instance has few points: an instance not yet observed would otherwise
        keep the default rates, look many times slower (or faster) than its calibrated
        peers, and never be chosen (so never observed) again."""
        if prior.n <= 0:
            return self.fixed_s, self.scale, self.per_request_s
        w = self.n / (self.n + strength)
        return (
            w * self.fixed_s + (1 - w) * prior.fixed_s,
            w * self.scale + (1 - w) * prior.scale,
            w * self.per_request_s + (1 - w) * prior.per_request_s,
        )
