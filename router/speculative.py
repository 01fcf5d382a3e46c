"""Predict-on-route: remember what a just-routed request will leave cached, per group.

An engine publishes a request's ``BlockStored`` events only once it schedules it, and the
router sees them a few milliseconds to seconds later. Meanwhile a burst of requests with
the same prefix would all look cold and scatter. So after routing, the router records, for
a short TTL, the blocks the chosen instance *will* cache for the prompt -- per KV cache
group, as ``events.retention`` says vLLM keeps them (every full-attention block, only the
window tails a sliding-window group retains, only the Mamba states at checkpoints) -- and
the scorer ORs them into the index's GPU residency before the one hit rule runs. Crediting
every group with every block would predict hits vLLM cannot serve.

An entry lives while its request is in flight and, once the response ends (``settle``),
until the router next applies a batch of that instance's events (``flush``): the engine
published what it cached before it answered, so from then on the index is the truth, and
an entry outliving it could credit blocks the engine has since evicted (that eviction
comes in such a batch). ``ttl_s`` bounds an entry's life in any case; an answered
request whose TTL passes before that batch is released then (an instance may publish none).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import groupby
from operator import itemgetter

from router.index.base import Residency, Tier, slot_of

__all__ = ["SpeculativeResidency"]

_GPU = int(Tier.GPU)
_first, _second = itemgetter(0), itemgetter(1)


@functools.cache
def _gpu_slots(groups: int) -> tuple[int, ...]:
    """The GPU residency slots of the groups set in a bitmask."""
    return tuple(slot_of(g, _GPU) for g in range(groups.bit_length()) if groups >> g & 1)


def _groups_of(held: Mapping[int, Iterable[int]]) -> tuple[dict[int, int], int, list[int]]:
    """``(hash -> bitmask of the groups holding it, the bitmask most hashes have, the
    hashes with another)``. Groups holding the same positions (every full-attention group)
    are one ``dict.fromkeys`` over the longest list; only the others (window tails, Mamba
    states: a few blocks) are merged hash by hash."""
    if len(held) == 1:  # one group (full attention alone)
        ((g, hs),) = held.items()
        return dict.fromkeys(hs, 1 << g), 1 << g, []
    lists = sorted(((list(hs), g) for g, hs in held.items()), key=lambda t: -len(t[0]))
    if not lists:
        return {}, 0, []
    first = lists[0][0]
    bits = 0
    rest = []
    for hs, g in lists:
        if hs == first:
            bits |= 1 << g
        else:
            rest.append((hs, 1 << g))
    out = dict.fromkeys(first, bits)
    odd = []
    for hs, bit in rest:
        for h in hs:
            out[h] = out.get(h, 0) | bit
            odd.append(h)
    return out, bits, odd


# An entry: (instance, expiry, group bitmask, requests holding it). Immutable, so the
# blocks one request records share one entry (a C-level ``dict.update``), and blocks
# updated together stay shared: residency and purging then handle runs, not blocks.
_Entry = tuple[str, float, int, int]


class SpeculativeResidency:
    """``hash -> entry`` (one instance holds it) or ``hash -> {instance: entry}``; read
    as per-slot position masks."""

    def __init__(self, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._held: dict[int, _Entry | dict[str, _Entry]] = {}
        # Answered, awaiting the next batch: instance -> id(hashes) -> hashes. Released
        # at that batch, or when they expire if it never comes (an instance publishing no
        # events): kept until then, they grew without bound.
        self._settled: dict[str, dict[int, list[int]]] = {}
        # (expiry, instance, hashes) in recording order, hence expiry order: purging looks
        # only at what expired, not at every entry (a full scan cost ~8% of the router's
        # CPU under load).
        self._expiries: deque[tuple[float, str, list[int]]] = deque()
        self._unexpired: set[int] = set()  # id() of the hash lists still in _expiries

    def now(self) -> float:
        """The clock entries expire by."""
        return self._clock()

    def record(self, instance: str, held: Mapping[int, Iterable[int]]) -> list[int]:
        """``held``: group_idx -> wire hashes that group will cache on ``instance``.
        Returns the hashes recorded, to :meth:`release` when the request ends."""
        if self.ttl_s <= 0:
            return []
        now = self._clock()
        expiry = now + self.ttl_s
        # Purge first: an expired request released here still counts in the entries it
        # holds (none was renewed past its expiry yet, which starts a count afresh).
        if self._expiries and self._expiries[0][0] <= now:
            self.purge(now)
        groups_of, bits, odd = _groups_of(held)
        store = self._held
        # One lookup and one write per block in the (large) store; the rest on small dicts.
        fresh = dict.fromkeys(groups_of, (instance, expiry, bits, 1))
        for h in odd:
            fresh[h] = (instance, expiry, groups_of[h], 1)
        found = list(map(store.get, groups_of))
        if found.count(None) != len(found):  # blocks held before (a shared prefix)
            shared = [h for h, v in zip(groups_of, found, strict=True) if v is not None]
            olds = [v for v in found if v is not None]
            v = olds[0]
            if not odd and type(v) is tuple and v[0] == instance and olds.count(v) == len(olds):
                fresh.update(dict.fromkeys(shared, _renewed(v, instance, expiry, bits, now)))
            else:
                fresh.update(self._renew(shared, olds, groups_of, instance, expiry, now))
        store.update(fresh)
        recorded = list(groups_of)
        self._expiries.append((expiry, instance, recorded))
        self._unexpired.add(id(recorded))
        return recorded

    @staticmethod
    def _renew(
        hashes: list[int], olds: list, groups_of: dict[int, int], instance: str, expiry: float,
        now: float,
    ) -> dict[int, _Entry | dict[str, _Entry]]:  # fmt: skip
        """New values for blocks held before, one new entry per distinct (old entry, groups)."""
        out: dict[int, _Entry | dict[str, _Entry]] = {}
        made: dict[tuple[int, int], _Entry] = {}
        for h, v in zip(hashes, olds, strict=True):
            g = groups_of[h]
            if type(v) is dict:
                v[instance] = _renewed(v.get(instance), instance, expiry, g, now)
                out[h] = v
            elif v[0] != instance:
                out[h] = {v[0]: v, instance: (instance, expiry, g, 1)}
            else:
                key = (id(v), g)
                e = made.get(key)
                if e is None:
                    e = made[key] = _renewed(v, instance, expiry, g, now)
                out[h] = e
        return out

    def settle(self, instance: str, hashes: list[int]) -> None:
        """The request that recorded ``hashes`` on ``instance`` has been answered: release
        them at the next :meth:`flush` of that instance, or now if their TTL already
        passed (purged before the answer: no expiry would release them later, and an
        instance that publishes no events never flushes)."""
        if id(hashes) not in self._unexpired:
            self.release(instance, hashes)
            return
        self._settled.setdefault(instance, {})[id(hashes)] = hashes

    def flush(self, instance: str) -> None:
        """A batch of ``instance``'s events was applied: hand settled entries to the index."""
        settled = self._settled.pop(instance, None)
        for hashes in settled.values() if settled else ():
            self.release(instance, hashes)

    def release(self, instance: str, hashes: Iterable[int]) -> None:
        """Drop the entries of one request, unless another request in flight holds them."""
        store = self._held
        hashes = hashes if isinstance(hashes, list) else list(hashes)
        for v, run in groupby(zip(map(store.get, hashes), hashes, strict=True), _first):
            if v is None:
                continue
            if type(v) is dict:
                for holders, h in run:
                    e = holders.get(instance)
                    if e is None:
                        continue
                    if e[3] > 1:
                        holders[instance] = (*e[:3], e[3] - 1)  # type: ignore[assignment]
                        continue
                    del holders[instance]
                    if not holders:
                        del store[h]
            elif v[0] == instance:  # a run sharing one entry: one new entry, or none
                keys = map(_second, run)
                if v[3] > 1:
                    store.update(dict.fromkeys(keys, (*v[:3], v[3] - 1)))
                else:
                    deque(map(store.__delitem__, keys), maxlen=0)

    def residency(
        self, block_hashes: Sequence[int], instances: Iterable[str]
    ) -> dict[str, Residency]:
        """Per instance, GPU-slot bitmasks over ``block_hashes`` positions (absent: none)."""
        if not self._held:
            return {}
        now = self._clock()
        wanted = set(instances)
        # Positions per (instance, group set), a run of blocks sharing one entry at a time
        # (groupby runs in C); spread over the groups' GPU slots once at the end.
        acc: dict[tuple[str, int], int] = {}
        lo = 0
        for v, run in groupby(map(self._held.get, block_hashes)):
            hi = lo + len(list(run))
            if v is not None:
                mask = (1 << hi) - (1 << lo)
                for e in v.values() if type(v) is dict else (v,):  # type: ignore[attr-defined]
                    if e[1] > now and e[0] in wanted:
                        key = (e[0], e[2])
                        acc[key] = acc.get(key, 0) | mask
            lo = hi
        out: dict[str, Residency] = {}
        for (name, groups), positions in acc.items():
            res = out.setdefault(name, {})
            for slot in _gpu_slots(groups):
                res[slot] = res.get(slot, 0) | positions
        return out

    def forget(self, instance: str) -> None:
        self._settled.pop(instance, None)
        store = self._held
        dead = []
        for h, v in store.items():
            if type(v) is dict:
                v.pop(instance, None)
                if not v:
                    dead.append(h)
            elif v[0] == instance:  # type: ignore[index]
                dead.append(h)
        for h in dead:
            del store[h]
        self.purge(self._clock())

    def purge(self, now: float) -> None:
        """Drop the entries that expired by ``now``."""
        queue, store = self._expiries, self._held
        get = store.get
        while queue and queue[0][0] <= now:
            _, name, hashes = queue.popleft()
            self._unexpired.discard(id(hashes))
            settled = self._settled.get(name)
            if settled and settled.pop(id(hashes), None) is not None:
                self.release(name, hashes)  # answered: released as that batch would
            for v, run in groupby(zip(map(get, hashes), hashes, strict=True), _first):
                if v is None:
                    continue
                if type(v) is not dict:
                    if v[1] <= now and v[0] == name:  # a run recorded together: in C
                        deque(map(store.__delitem__, map(_second, run)), maxlen=0)
                    continue
                for holders, h in run:
                    e = holders.get(name)
                    if e is not None and e[1] <= now:
                        del holders[name]
                        if not holders:
                            del store[h]

    def __len__(self) -> int:
        return len(self._held)


def _renewed(e: _Entry | None, instance: str, expiry: float, groups: int, now: float) -> _Entry:
    """``e`` held once more until ``expiry`` (a fresh entry where it had expired)."""
    if e is None or e[1] <= now:
        return (instance, expiry, groups, 1)
    return (instance, expiry, e[2] | groups, e[3] + 1)
