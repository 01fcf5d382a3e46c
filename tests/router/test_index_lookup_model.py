"""Lookups against a naive model of residency, on both backends: random stores, removals,
clears and instance drops over many (instance, group, tier) columns, then lookups of
random requests restricted to random candidate sets (including instances whose columns
sit above every column present in the request, and unknown names)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from routerkit import batch, need_native, removed, stored

from events.structs import AllBlocksCleared
from router.index import MemoryIndex, Tier, slot_of, table

NAMES = [f"i{k}" for k in range(9)]
POOL = [5000 + i for i in range(40)]
MEDIA = {Tier.GPU: "GPU", Tier.CPU: "CPU"}


def model_lookup(model, hashes, instances):
    want = set(model) if instances is None else set(instances) & set(model)
    out: dict[str, dict[int, int]] = {}
    for name in sorted(want):
        for slot, counts in model[name].items():
            mask = sum(1 << i for i, h in enumerate(hashes) if counts[h] > 0)
            if mask:
                out.setdefault(name, {})[slot] = mask
    return out


@pytest.mark.parametrize("path", ["runs", "transpose", "native"])
async def test_lookup_equals_a_naive_model_of_residency(index, path, monkeypatch):
    """The memory index ORs runs of one holder set, or transposes with numpy when
    residency is fragmented (``_RUN_BITS_MAX``), or does the runs in C where
    ``router.index._memindex`` is built: every way, the model's answer."""
    if isinstance(index, MemoryIndex):
        if path == "native":
            need_native(table._native is not None, "router.index._memindex")
        else:
            monkeypatch.setattr(table, "_RUN_BITS_MAX", 2048 if path == "runs" else 0)
        index = MemoryIndex(native=path == "native")
    rng = random.Random(7)
    model: dict[str, dict[int, Counter]] = {}
    unconfirmed: set[str] = set()  # CPU tier kept by an AllBlocksCleared, not yet confirmed
    for step in range(160):
        name = rng.choice(NAMES)
        group, tier = rng.randrange(3), rng.choice([Tier.GPU, Tier.CPU])
        slot = slot_of(group, tier)
        roll = rng.random()
        if roll < 0.6:
            hs = rng.sample(POOL, rng.randint(1, 8))
            await index.apply(name, batch(stored(hs, group, MEDIA[tier])))
            held = model.get(name, {}).get(slot) or Counter()
            if name in unconfirmed and tier is Tier.CPU and held[hs[-1]] > 0:
                unconfirmed.discard(name)  # a re-stored CPU key: that reset emptied the tier
                model[name] = {s: c for s, c in model[name].items() if s % 2 == Tier.GPU}
            model.setdefault(name, {}).setdefault(slot, Counter()).update(hs)
        elif roll < 0.85:
            counts = model.get(name, {}).get(slot)
            held = [h for h, n in (counts or {}).items() if n > 0]
            if held:
                hs = rng.sample(held, rng.randint(1, len(held)))
                await index.apply(name, batch(removed(hs, group, MEDIA[tier])))
                counts.subtract(hs)
        elif roll < 0.93:
            await index.apply(name, batch(AllBlocksCleared()))
            cpu = {s: c for s, c in model.get(name, {}).items() if s % 2 == Tier.CPU}
            model[name] = cpu  # the GPU tier goes, the CPU tier stays (unconfirmed)
            if cpu:
                unconfirmed.add(name)
        else:
            await index.clear(name)
            model.pop(name, None)
            unconfirmed.discard(name)
        if step % 8 == 0:
            hashes = rng.choices(POOL, k=rng.randint(1, 24))
            cands = (
                None if rng.random() < 0.3 else rng.sample([*NAMES, "nobody"], rng.randint(0, 4))
            )
            got = await index.lookup(hashes, cands)
            assert got == model_lookup(model, hashes, cands), (step, cands)
