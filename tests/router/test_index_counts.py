"""``column_counts``: distinct blocks per instance, group and tier (the dashboard's residency
table), on both backends, through stores, duplicate stores, removals and clears."""

from __future__ import annotations

from routerkit import batch, removed, stored

from router.index.base import NUM_TIERS, Tier, slot_of

GPU0 = slot_of(0, Tier.GPU)
CPU0 = slot_of(0, Tier.CPU)
GPU1 = slot_of(1, Tier.GPU)


async def test_counts_follow_stores_removals_and_clears(index):
    assert await index.column_counts() == {}
    await index.apply(
        "a",
        batch(
            stored([1, 2, 3], 0, "GPU"),
            stored([2], 0, "GPU"),  # a second reference: still one distinct block
            stored([3], 0, "CPU"),
            stored([7, 8], 1, "GPU"),
        ),
    )
    await index.apply("b", batch(stored([1], 0, "GPU")))
    assert await index.column_counts() == {"a": {GPU0: 3, CPU0: 1, GPU1: 2}, "b": {GPU0: 1}}

    # The duplicate's first removal keeps the block; the second releases it.
    await index.apply("a", batch(removed([2], 0, "GPU"), removed([7], 1, "GPU")))
    assert (await index.column_counts())["a"] == {GPU0: 3, CPU0: 1, GPU1: 1}
    await index.apply("a", batch(removed([2, 99], 0, "GPU")))
    assert (await index.column_counts())["a"] == {GPU0: 2, CPU0: 1, GPU1: 1}

    await index.clear("a")
    assert await index.column_counts() == {"b": {GPU0: 1}}
    assert NUM_TIERS == 2  # slot = group * 2 + tier, as the dashboard decodes it
