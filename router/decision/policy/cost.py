"""The cost policy (``cost``, the default): sticky minimum-cost routing.

Contract: ``choose`` ranks every candidate (the chosen one first, the rest as retry
fallbacks) by the prefill work a choice spends, stretched by the work it shares the
engine with, and never by list order:

    credited  = hit (GPU + CPU)
                + junction_credit * (full-attention-only prefix - best hit anywhere)
    objective = fleet scale * (prompt - credited) * prefill rate
                * (1 + requests there + others waiting) ** exponent

``exponent`` is ``load_exponent`` for a mostly-new prompt and ``continuation_exponent``
for a continuation (some instance holds ``continuation_fraction`` of it); on a holder with
KV room (``roomy``, ``router.prediction.pressure``) the continuation thresholds are the
``roomy_*`` ones. ``full_tokens`` is credited only beyond the best hit any candidate has
now. Hysteresis: the holder of the longest credited prefix keeps the request while its
objective is within ``1 + stick_margin`` of the best, unless the best-ranked candidate
holds that prefix too. Ties: least load, then the fewest uncached tokens ``assigned``
there lately (decayed, ``recent_half_life_s``), then at random. A softmax ``temperature``
samples on the objective instead.

Each candidate also gets a predicted TTFT (``Breakdown``, lazy: ``Decision.breakdown``)
from its backlog and its TTFT fit (``router.decision.policy.fit``), as of the decision;
``observe`` feeds the fit after a first byte. Policies do no I/O, so the simulator runs
them unchanged. Why these terms and constants: docs/design/cost-policy.md.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from router.config import CostSettings
from router.decision.policy.base import Breakdown, Candidate, CostRates, Decision, Policy
from router.decision.policy.fit import Backlog, TtftFit

__all__ = ["CostPolicy"]


_new = tuple.__new__  # a NamedTuple from a tuple, without its Python-level __new__


@dataclass(slots=True)
class _Model:
    backlog: Backlog = field(default_factory=Backlog)
    fit: TtftFit = field(default_factory=TtftFit)
    recent: float = 0.0  # uncached tokens routed here, decayed, as of ``recent_t``
    recent_t: float = 0.0

    def recent_at(self, now: float, half_life_s: float) -> float:
        if not self.recent:
            return 0.0
        decay: float = 0.5 ** ((now - self.recent_t) / half_life_s)
        return self.recent * decay


class CostPolicy(Policy):
    """Sticky minimum-cost routing (see module docstring)."""

    name = "cost"

    def __init__(
        self,
        settings: CostSettings | None = None,
        *,
        temperature: float = 0.0,
        roomy: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        name: str = "cost",
    ) -> None:
        """``settings``: the rates and the ranking's knobs (``router.config.CostSettings``,
        where their defaults and bounds are written); ``roomy``: instance -> it has KV room
        (``prediction.pressure``), None: unknown; ``name``: what reports call it
        (``prefix_full_only`` is this policy over a full-attention-only scorer)."""
        self.name = name
        s = self.defaults = settings or CostSettings()
        self.temperature = temperature
        self.roomy = roomy
        self.clock = clock
        self.models: dict[str, _Model] = {}
        self.fleet = TtftFit(s.fit_decay)  # every observation: the prior of a new instance
        self._rng = rng or random.Random()

    def model(self, name: str) -> _Model:
        m = self.models.get(name)
        if m is None:
            m = self.models[name] = _Model(fit=TtftFit(self.defaults.fit_decay))
        return m

    def credited(self, c: Candidate, num_prompt_tokens: int, best_hit: int = 0) -> int:
        """Tokens the ranking credits: the hit, plus ``junction_credit`` x the longer prefix
        full attention alone holds beyond ``best_hit`` (the best hit any candidate has now):
        routing there re-creates the sparse state at that junction, so the conversation's
        next requests hit in full. What another instance can serve from cache right now
        is not credited twice: an instance that kept its window blocks still wins."""
        # Conditionals, not min/max: this runs per candidate per decision.
        cached = c.gpu_tokens + c.cpu_tokens
        if cached > num_prompt_tokens:
            cached = num_prompt_tokens
        full = c.full_tokens if c.full_tokens < num_prompt_tokens else num_prompt_tokens
        extra = full - (cached if cached > best_hit else best_hit)
        return cached + int(self.defaults.junction_credit * extra) if extra > 0 else cached

    def exponent(self, num_prompt_tokens: int, best_hit: int, holder: str | None = None) -> float:
        """The load exponent for a request whose best hit anywhere is ``best_hit``, held by
        ``holder``: on a holder with KV room a continuation starts lower and bends less."""
        roomy = self.roomy
        if (
            holder is not None
            and roomy is not None
            and best_hit >= self.defaults.roomy_continuation_fraction * num_prompt_tokens
            and roomy(holder)
        ):
            return self.defaults.roomy_continuation_exponent
        if best_hit >= self.defaults.continuation_fraction * num_prompt_tokens:
            return self.defaults.continuation_exponent
        return self.defaults.load_exponent

    def breakdown(
        self,
        c: Candidate,
        num_prompt_tokens: int,
        now: float,
        best_hit: int = 0,
        exponent: float | None = None,
        holder: str | None = None,
    ) -> Breakdown:
        """One candidate's terms as a decision at ``now`` works them out (it updates the
        candidate's backlog; ``choose`` does the same update, then these terms lazily)."""
        m = self.models.get(c.name) or self.model(c.name)
        k = m.fit.blended(self.fleet)[1]
        rate = self.defaults.prefill_s_per_token
        backlog = m.backlog.update(now, c.inflight_prefill_tokens, 1.0 / (k * rate))
        credited = self.credited(c, num_prompt_tokens, best_hit)
        # The ranking: fleet-scaled seconds of prefill this choice spends, stretched by
        # the requests it shares the engine with (module docstring).
        effective = num_prompt_tokens - credited if num_prompt_tokens - credited > 1 else 1
        others = c.engine_waiting - c.inflight_requests
        if others < 0:
            others = 0
        if exponent is None:
            exponent = self.exponent(num_prompt_tokens, best_hit, holder)
        stretch = (1 + c.inflight_requests + c.running_requests + others) ** exponent
        objective = self.fleet.scale * effective * rate * stretch
        return _terms(
            self.defaults, m.fit, self.fleet, c, num_prompt_tokens, backlog, objective, credited
        )

    def choose(self, candidates: Sequence[Candidate], num_prompt_tokens: int) -> Decision:
        now = self.clock()
        n = num_prompt_tokens
        best_hit = 0
        holder = None
        for c in candidates:
            hit = c.gpu_tokens + c.cpu_tokens
            if hit > best_hit:
                best_hit, holder = hit, c.name
        best_hit = min(best_hit, n)
        shuffled = list(candidates)
        self._rng.shuffle(shuffled)  # ties: random, never list order
        models, fleet = self.models, self.fleet
        rate = self.defaults.prefill_s_per_token
        scale, junction = fleet.scale, self.defaults.junction_credit
        half_life = self.defaults.recent_half_life_s
        exponent = self.exponent(n, best_hit, holder)
        # Per candidate only what the ranking reads (``breakdown``'s objective, inlined:
        # this loop runs per instance per decision) and the backlog update, which must
        # happen now; the rest of its ``Breakdown`` is worked out when read.
        inputs: dict[str, tuple[Candidate, float, TtftFit, float, int]] = {}
        keys = []
        rounded: dict[float, float] = {}
        for i, c in enumerate(shuffled):
            name, gpu, cpu, requests, inflight, running, waiting, full = c  # every field
            m = models.get(name) or self.model(name)
            fit, backlog = m.fit, m.backlog
            if backlog.tokens == 0.0 and inflight == backlog.seen_inflight and inflight >= 0:
                queued = 0.0  # idle: ``Backlog.update`` would change nothing that is read
            else:
                queued = backlog.update(now, inflight, 1.0 / (fit.blended(fleet)[1] * rate))
            cached = gpu + cpu
            if cached > n:
                cached = n
            if full > n:
                full = n
            extra = full - (cached if cached > best_hit else best_hit)
            credited = cached + int(junction * extra) if extra > 0 else cached  # credited()
            effective = n - credited if n - credited > 1 else 1
            others = waiting - requests
            if others < 0:
                others = 0
            objective = scale * effective * rate * (1 + requests + running + others) ** exponent
            inputs[name] = (c, queued, fit, objective, credited)
            # The ranking key: the objective to 12 digits (round() formats the float: once
            # per distinct value), then load (``_load_key``), then the work routed there
            # lately, then the shuffled order.
            key = rounded.get(objective)
            if key is None:
                key = rounded[objective] = round(objective, 12)
            recent = m.recent_at(now, half_life) if m.recent else 0.0
            keys.append((key, inflight, requests + waiting, running, recent, i))
        keys.sort()
        ranked = [shuffled[k[5]].name for k in keys]
        reason = "min_cost"
        if self.temperature > 0 and len(ranked) > 1:
            best = inputs[ranked[0]][3]
            weights = [math.exp(-(inputs[name][3] - best) / self.temperature) for name in ranked]
            pick = self._rng.choices(ranked, weights)[0]
            ranked.remove(pick)
            ranked.insert(0, pick)
            reason = "sampled"
        else:
            holder = self._sticky(ranked, inputs, n)
            if holder is not None and holder != ranked[0]:
                ranked.remove(holder)
                ranked.insert(0, holder)
                reason = "sticky"
        parts = _Breakdowns(self.defaults, fleet, n, inputs)
        return Decision(ranked[0], ranked, parts, reason)

    def _sticky(
        self,
        ranked: list[str],
        inputs: dict[str, tuple[Candidate, float, TtftFit, float, int]],
        num_prompt_tokens: int,
    ) -> str | None:
        """Hysteresis: the holder of the longest credited prefix keeps the request while
        its objective is within ``1 + stick_margin`` times the best alternative's, unless
        that alternative holds the prefix too (its hit or full-attention prefix)."""
        credits = [inputs[name][4] for name in ranked]
        credit = max(credits)
        holder = ranked[credits.index(credit)]  # the first of equals: the better-ranked
        if credit <= 0 or credit < self.defaults.min_sticky_fraction * num_prompt_tokens:
            return None
        # Hysteresis keeps a prefix where it is: if the best-ranked candidate holds it in
        # full attention too (a shared system prompt, a sibling's junction), going there
        # moves nothing -- vLLM resumes at its hit and keeps the sparse state at the
        # junction -- so the objective alone decides.
        first = inputs[ranked[0]][0]
        if first.full_tokens >= credit or first.gpu_tokens + first.cpu_tokens >= credit:
            return None
        best = inputs[ranked[0]][3]
        if inputs[holder][3] <= (1 + self.defaults.stick_margin) * best:
            return holder
        return None

    def assigned(self, instance: str, uncached_tokens: int) -> None:
        """A request was routed to ``instance`` with ``uncached_tokens`` to prefill there
        (the cold tie-break above; ``choose`` alone does not count: ``/debug/route``)."""
        m = self.model(instance)
        now = self.clock()
        m.recent = m.recent_at(now, self.defaults.recent_half_life_s) + uncached_tokens
        m.recent_t = now

    def observe(self, instance: str, predicted: Breakdown | float, observed_ttft_s: float) -> None:
        """Fit ``instance``'s TTFT on the raw prediction made when the request was routed
        (pass the decision's ``Breakdown``; a bare float is taken as a raw prediction)."""
        if isinstance(predicted, Breakdown):
            raw, requests = predicted.raw_s, predicted.requests
        else:
            raw, requests = float(predicted), 0
        # New fit objects, not changed in place: decisions already made read theirs.
        m = self.model(instance)
        m.fit = m.fit.added(raw, observed_ttft_s, requests)
        self.fleet = self.fleet.added(raw, observed_ttft_s, requests)


def _terms(
    r: CostRates,
    fit: TtftFit,
    fleet: TtftFit,
    c: Candidate,
    num_prompt_tokens: int,
    backlog: float,
    objective: float,
    credited: int,
) -> Breakdown:
    """A candidate's predicted TTFT terms from its backlog and fit as of the decision."""
    fixed, k, per_request = fit.blended(fleet)
    rate = r.prefill_s_per_token
    cached = c.gpu_tokens + c.cpu_tokens
    if cached > num_prompt_tokens:
        cached = num_prompt_tokens
    # the last token is always computed
    uncached = num_prompt_tokens - cached if num_prompt_tokens - cached > 1 else 1
    # engine_waiting counts our own in-flight requests too: only the rest is extra.
    others = c.engine_waiting - c.inflight_requests
    if others < 0:
        others = 0
    queue = backlog * rate + others * r.request_overhead_s
    prefill = uncached * rate
    load = (c.cpu_tokens if c.cpu_tokens < cached else cached) * r.load_s_per_token
    steps = math.ceil((backlog + uncached) / r.step_tokens)
    per_step = r.step_s
    if c.running_requests:
        per_step += r.decode_step_s + c.running_requests * r.decode_s_per_seq
    decode = steps * per_step
    raw = queue + prefill + load + decode
    requests = c.inflight_requests + c.running_requests  # what the fit's wait term scales
    return _new(
        Breakdown,
        (
            k * queue,
            k * prefill,
            k * load,
            k * decode,
            fixed,
            per_request * requests,
            raw,
            requests,
            objective,
            cached,
            credited,
        ),
    )


class _Breakdowns(Mapping[str, Breakdown]):
    """``Decision.breakdown`` of the cost policy: each candidate's ``Breakdown`` worked out
    on first read, from what the decision saw (candidate, backlog value, fit objects,
    objective and credit). Most decisions read only the chosen one's, once."""

    __slots__ = ("_done", "_fleet", "_inputs", "_n", "_rates")

    def __init__(
        self,
        rates: CostRates,
        fleet: TtftFit,
        num_prompt_tokens: int,
        inputs: dict[str, tuple[Candidate, float, TtftFit, float, int]],
    ) -> None:
        self._rates, self._fleet, self._n, self._inputs = rates, fleet, num_prompt_tokens, inputs
        self._done: dict[str, Breakdown] = {}

    def __getitem__(self, name: str) -> Breakdown:
        part = self._done.get(name)
        if part is None:
            c, backlog, fit, objective, credited = self._inputs[name]
            part = self._done[name] = _terms(
                self._rates, fit, self._fleet, c, self._n, backlog, objective, credited
            )
        return part

    def __contains__(self, name: object) -> bool:
        return name in self._inputs

    def __iter__(self) -> Iterator[str]:
        return iter(self._inputs)

    def __len__(self) -> int:
        return len(self._inputs)

    def __repr__(self) -> str:
        return f"_Breakdowns({dict(self)!r})"
