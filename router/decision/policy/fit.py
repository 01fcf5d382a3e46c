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

from dataclasses import dataclass

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
    """Gauss-Jordan elimination with partial pivoting (the first largest pivot) of the
    augmented matrix ``a`` (rows ``[*coefficients, value]``, changed in place); None when
    singular. Plain loops: it runs up to twice per observed response. A pivot column's
    entries in the other rows are left as they are (they would be rounding residue that
    nothing reads again), so each row operation starts right of the pivot."""
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
                for k in range(c + 1, n + 1):
                    row[k] -= f * pivot_row[k]
    return [a[i][n] / a[i][i] for i in range(n)]


@dataclass(slots=True)
class TtftFit:
    """Weighted least squares of observed TTFT on (1, work, requests), forgetting old
    points by ``decay`` per observation (about ``1 / (1 - decay)`` points of memory).
    Implausible solutions (a negative coefficient) fall back to fewer terms, down to a
    plain ratio of observed to predicted.

    The decayed sums of ``x x^T`` and ``x y`` for ``x = (1, w, r)`` are kept as plain
    floats (``n`` is the sum of 1s): the fit runs twice per observed response, and nested
    lists cost more to build than the arithmetic."""

    decay: float = 0.95
    n: float = 0.0
    sw: float = 0.0  # sum of w
    sr: float = 0.0  # sum of r
    sww: float = 0.0
    swr: float = 0.0
    srr: float = 0.0
    sy: float = 0.0  # sum of y
    swy: float = 0.0
    sry: float = 0.0
    fixed_s: float = 0.0
    scale: float = 1.0
    per_request_s: float = 0.0

    def add(self, work_s: float, observed_s: float, requests: float = 0.0) -> None:
        if work_s <= 0 or observed_s <= 0:
            return
        y = min(max(observed_s, work_s * 1e-4), work_s * 1e4)  # bound an outlier
        d, w, r = self.decay, work_s, float(requests)
        self.n = self.n * d + 1.0
        self.sw = self.sw * d + w
        self.sr = self.sr * d + r
        self.sww = self.sww * d + w * w
        self.swr = self.swr * d + w * r
        self.srr = self.srr * d + r * r
        self.sy = self.sy * d + y
        self.swy = self.swy * d + w * y
        self.sry = self.sry * d + r * y
        self._fit()

    def added(self, work_s: float, observed_s: float, requests: float = 0.0) -> TtftFit:
        """A copy with one more point (``add``); this fit stays as it was, for the
        decisions that were made with it and read their predictions later."""
        new = TtftFit(
            self.decay, self.n, self.sw, self.sr, self.sww, self.swr, self.srr,
            self.sy, self.swy, self.sry, self.fixed_s, self.scale, self.per_request_s,
        )  # fmt: skip
        new.add(work_s, observed_s, requests)
        return new

    def _fit(self) -> None:
        n, sw, sr, sww, swr, srr = self.n, self.sw, self.sr, self.sww, self.swr, self.srr
        sy, swy, sry = self.sy, self.swy, self.sry
        fixed, scale, per = 0.0, swy / sww if sww else 1.0, 0.0  # ratio
        if sw > 0:  # the ratio of sums (observed over work) is steadier
            scale = sy / sw
        if n >= 6:
            # Most fitted first: (1, w, r), (w, r), (1, w). With no requests term at all
            # (srr == 0: every r was 0) the first two are singular: not tried.
            if srr > 0:
                sol = _solve([[n, sw, sr, sy], [sw, sww, swr, swy], [sr, swr, srr, sry]])
                if sol is not None and min(sol) >= 0 and sol[1] > 0:
                    self._set(sol[0], sol[1], sol[2])
                    return
                sol = _solve([[sww, swr, swy], [swr, srr, sry]])
                if sol is not None and min(sol) >= 0 and sol[0] > 0:
                    self._set(0.0, sol[0], sol[1])
                    return
            sol = _solve([[n, sw, sy], [sw, sww, swy]])
            if sol is not None and min(sol) >= 0 and sol[1] > 0:
                fixed, scale = sol
        self._set(fixed, scale, per)

    def _set(self, fixed: float, scale: float, per: float) -> None:
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
