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

Layout, chosen for the request path (it runs on every request): per instance, one
refcount table per *class* -- the groups that hold the same blocks of a prompt (every
full-attention group: the whole prompt; the sliding-window groups: their tails). A
request adds 1 to the count of each of its blocks and takes it back once, when it is
released or expires; a block is held while its count is positive. Every step runs as a
few C-level passes over the request's blocks. A class that holds whole prompts (full
attention) holds a union of hash chains, which is closed under prefixes -- a chain hash
names its whole prefix -- so what it holds of a query is a prefix, found by bisection in
a handful of lookups; the other classes (a few blocks per request) by one membership pass.
The refcounts live in ``router._refcounts.RefCounts`` (C, open addressing, 16 bytes an
entry) where it was built, else in ``PyRefCounts`` (a dict, the reference, same answers).
Why this shape: docs/design/cost-policy.md.
"""

from __future__ import annotations

import functools
import time
from array import array

# _count_elements: CPython's C loop behind Counter.update, absent from typeshed.
from collections import _count_elements, deque  # type: ignore[attr-defined]
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from events.native import load
from events.structs import BlockRemoved, KVEventBatch
from router.index.base import GPU_MEDIA, Residency, Tier, slot_of

__all__ = ["Held", "PyRefCounts", "SpeculativeResidency", "refcounts_type"]

_GPU = int(Tier.GPU)

# A class: (bitmask of its groups, True where they hold whole prompts).
_Class = tuple[int, bool]


@functools.cache
def _gpu_slots(groups: int) -> tuple[int, ...]:
    """The GPU residency slots of the groups set in a bitmask."""
    return tuple(slot_of(g, _GPU) for g in range(groups.bit_length()) if groups >> g & 1)


class PyRefCounts:
    """Block hash -> number of holders: the reference for ``router._refcounts.RefCounts``
    (the C table the store uses where it was built), same methods and answers."""

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: dict[int, int] = {}

    def add(self, hashes: Iterable[int]) -> None:
        """One more holder of each hash."""
        _count_elements(self._d, hashes)  # += 1 each, in C (what Counter.update runs)

    def remove(self, hashes: Iterable[int]) -> None:
        """One holder fewer of each hash; a hash held by none leaves (KeyError: not held)."""
        d = self._d
        for h in hashes:  # one touch per block: faster than C passes over a large dict
            v = d[h]
            if v > 1:
                d[h] = v - 1
            else:
                del d[h]

    def count(self, h: int) -> int:
        return self._d.get(h, 0)

    def prefix(self, hashes: Sequence[int]) -> int:
        """How many leading hashes are held, by bisection: exact when what is held is
        closed under prefixes of ``hashes`` (a union of hash chains)."""
        d, n = self._d, len(hashes)
        if not n or hashes[0] not in d:
            return 0
        if hashes[-1] in d:
            return n
        lo, hi = 1, n  # hashes[lo - 1] held, hashes[hi - 1] not
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if hashes[mid - 1] in d:
                lo = mid
            else:
                hi = mid
        return lo

    def mask(self, hashes: Sequence[int]) -> int:
        """Bit i set where ``hashes[i]`` is held."""
        d, m = self._d, 0
        for i, h in enumerate(hashes):
            if h in d:
                m |= 1 << i
        return m

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, h: object) -> bool:
        return h in self._d


def refcounts_type() -> type:
    """The table class the store uses: the C one unless it was not built or
    ``KVROUTE_NO_NATIVE=1`` is set (``events.native.load``)."""
    mod = load("router._refcounts")
    return mod.RefCounts if mod is not None else PyRefCounts


class Held:
    """What one routed request recorded on one instance: the handle ``record`` returns
    and ``settle``/``release`` take back. Iterating it gives its block hashes."""

    __slots__ = ("expiry", "instance", "live", "parts")

    def __init__(
        self, instance: str, expiry: float, parts: list[tuple[_Class, Any, list[int]]]
    ) -> None:
        self.instance = instance
        self.expiry = expiry
        self.parts = parts  # (class, its refcounts, this request's hashes in it)
        self.live = True

    def __iter__(self) -> Iterator[int]:
        return iter(dict.fromkeys(h for _, _, hs in self.parts for h in hs))


class SpeculativeResidency:
    """Per instance, per class of groups: ``hash -> requests holding it``."""

    def __init__(
        self,
        ttl_s: float,  # router.config.SpeculativeSettings.ttl_s
        clock: Callable[[], float] = time.monotonic,
        table: type | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        # Refcounts of one class on one instance (``refcounts_type()`` by default).
        self._table = table if table is not None else refcounts_type()
        # The C table reads a uint64 array without converting each int: one array per
        # query for every table asked about it.
        self._packed = self._table is not PyRefCounts
        self._classes: dict[str, dict[_Class, Any]] = {}
        # Answered, awaiting the next batch: instance -> id(handle) -> handle. Released
        # at that batch, or when they expire if it never comes (an instance publishing no
        # events): kept until then, they grew without bound.
        self._settled: dict[str, dict[int, Held]] = {}
        # Handles in recording order, hence expiry order (one TTL): purging looks only at
        # what expired.
        self._expiries: deque[Held] = deque()
        # instance -> GPU slot -> hashes recorded here that the engine has since evicted
        # from that group (``observe``): no longer credited.
        self._evicted: dict[str, dict[int, set[int]]] = {}

    def now(self) -> float:
        """The clock entries expire by."""
        return self._clock()

    def record(
        self, instance: str, held: Mapping[int, Iterable[int]], whole: int = 0
    ) -> Held | None:
        """``held``: group_idx -> wire hashes that group will cache on ``instance``, in
        prompt order; ``whole``: the groups among them that cache every block of the
        prompt from the first (full attention). Returns the handle to :meth:`settle` or
        :meth:`release` when the request ends (None: predict-on-route is off)."""
        if self.ttl_s <= 0:
            return None
        now = self._clock()
        if self._expiries and self._expiries[0].expiry <= now:
            self.purge(now)
        # Groups holding the same blocks are one class: one count per block, not per group.
        lists: list[tuple[list[int], int, bool]] = []
        for g, hs in held.items():
            hs = hs if isinstance(hs, list) else list(hs)
            if not hs:
                continue
            is_whole = bool(whole >> g & 1)
            for i, (other, bits, w) in enumerate(lists):
                if w == is_whole and other == hs:
                    lists[i] = (other, bits | 1 << g, w)
                    break
            else:
                lists.append((hs, 1 << g, is_whole))
        classes = self._classes.setdefault(instance, {})
        parts = []
        for hs, bits, is_whole in lists:
            key = (bits, is_whole)
            counts = classes.get(key)
            if counts is None:
                counts = classes[key] = self._table()
            counts.add(hs)
            parts.append((key, counts, hs))
        handle = Held(instance, now + self.ttl_s, parts)
        self._expiries.append(handle)
        return handle

    def settle(self, instance: str, handle: Held | None) -> None:
        """The request behind ``handle`` has been answered: release it at the next
        :meth:`flush` of ``instance``, or now if its TTL already passed (nothing to keep)."""
        if handle is None or not handle.live:
            return
        self._settled.setdefault(instance, {})[id(handle)] = handle

    def flush(self, instance: str) -> None:
        """A batch of ``instance``'s events was applied: hand settled entries to the index."""
        settled = self._settled.pop(instance, None)
        for handle in settled.values() if settled else ():
            self.release(instance, handle)
        evicted = self._evicted.get(instance)
        if evicted and sum(map(len, evicted.values())) > 4096:
            self._prune_evicted(instance, evicted)

    def _prune_evicted(self, instance: str, evicted: dict[int, set[int]]) -> None:
        """Keep only evicted hashes some live entry still holds (bounds the sets on an
        instance that always has requests in flight)."""
        classes = self._classes.get(instance) or {}
        for slot in list(evicted):
            g = slot // 2
            tables = [c for (bits, _), c in classes.items() if bits >> g & 1]
            kept = {h for h in evicted[slot] if any(h in c for c in tables)}
            if kept:
                evicted[slot] = kept
            else:
                del evicted[slot]

    def release(self, instance: str, handle: Held | None) -> None:
        """Take one request's blocks back (each stays held while another request holds it).
        Releasing twice, or after the instance was forgotten, does nothing."""
        if handle is None or not handle.live:
            return
        handle.live = False
        classes = self._classes.get(instance)
        for key, counts, hs in handle.parts:
            counts.remove(hs)
            if not len(counts) and classes and classes.get(key) is counts:
                del classes[key]  # no request holds anything of it
        if instance in self._evicted and not classes:
            del self._evicted[instance]  # nothing recorded is left to mask

    def observe(self, instance: str, batch: KVEventBatch) -> None:
        """A batch of ``instance``'s events, before it is applied: a GPU ``BlockRemoved``
        of a block recorded here ends its credit in that group.

        vLLM publishes ``BlockRemoved`` exactly when it evicts a cached block
        (``BlockPool._maybe_evict_cached_block``), and a block it evicted stays gone until
        a later request stores it again (a new ``BlockStored``, which the index then
        holds). An entry kept until its request's next batch (``flush``) or its TTL would
        otherwise keep crediting it: a previous request's window tails and Mamba states,
        evicted while its longer prompt ran, credited as GPU hits where vLLM loads them
        from its CPU tier, or recomputes them. The CPU tier needs no credit moved to it:
        the index learns it from the connector's CPU events."""
        classes = self._classes.get(instance)
        if not classes:
            return
        # vLLM removes blocks one event each: gather the batch's GPU removals, then look
        # them up once per group, not once per event. Comprehensions, not a loop of calls:
        # a busy engine sends dozens per batch.
        removed = [ev for ev in batch.events if type(ev) is BlockRemoved and ev.medium in GPU_MEDIA]
        if not removed:
            return
        groups = {ev.group_idx or 0 for ev in removed}
        for g in groups:
            hs = [
                h
                for ev in removed
                if len(groups) == 1 or (ev.group_idx or 0) == g
                for h in ev.block_hashes
            ]
            held = [
                h
                for (bits, _), counts in classes.items()
                if bits >> g & 1
                for h in hs
                if type(h) is int and h in counts
            ]
            if held:
                slots = self._evicted.setdefault(instance, {})
                slots.setdefault(slot_of(g, _GPU), set()).update(held)

    def residency(
        self, block_hashes: Sequence[int], instances: Iterable[str]
    ) -> dict[str, Residency]:
        """Per instance, GPU-slot bitmasks over ``block_hashes`` positions (absent: none)."""
        if not self._classes:
            return {}
        now = self._clock()
        if self._expiries and self._expiries[0].expiry <= now:
            self.purge(now)
        if not block_hashes:
            return {}
        keys = array("Q", block_hashes) if self._packed else block_hashes
        out: dict[str, Residency] = {}
        for name in instances:
            classes = self._classes.get(name)
            if not classes:
                continue
            res: Residency = {}
            for (bits, is_whole), counts in classes.items():
                if is_whole:  # a prefix: bisect for its end
                    held = counts.prefix(keys)
                    if not held:
                        continue
                    mask = (1 << held) - 1
                else:
                    mask = counts.mask(keys)
                    if not mask:
                        continue
                for slot in _gpu_slots(bits):
                    res[slot] = res.get(slot, 0) | mask
            evicted = self._evicted.get(name)
            if evicted and res:
                for slot, gone in evicted.items():
                    m = res.get(slot)
                    if m:
                        res[slot] = m & ~_mask_of(block_hashes, gone)
            if res:
                out[name] = res
        return out

    def forget(self, instance: str) -> None:
        """The instance is gone: drop what was recorded on it (its handles go dead)."""
        self._settled.pop(instance, None)
        self._evicted.pop(instance, None)
        if self._classes.pop(instance, None) is None:
            return
        for handle in self._expiries:
            if handle.instance == instance:
                handle.live = False

    def purge(self, now: float) -> None:
        """Release the requests whose TTL passed by ``now``."""
        queue = self._expiries
        while queue and queue[0].expiry <= now:
            handle = queue.popleft()
            settled = self._settled.get(handle.instance)
            if settled:
                settled.pop(id(handle), None)
            self.release(handle.instance, handle)

    def __len__(self) -> int:
        """Distinct (instance, class, block) entries held."""
        return sum(len(c) for classes in self._classes.values() for c in classes.values())


def _mask_of(block_hashes: Sequence[int], hashes: set[int]) -> int:
    """Bit i set where ``block_hashes[i]`` is in ``hashes``."""
    m = 0
    for i, h in enumerate(block_hashes):
        if h in hashes:
            m |= 1 << i
    return m
