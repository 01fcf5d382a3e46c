"""The router on vLLM's CPU tier: the chunk size (configured from ``--kv-transfer-config``,
learned from self-describing events or from where placeholder events fall in the GPU hash
chains, else vLLM's default of one block), the CPU hit read with it, and predict-on-route
ending a block's GPU credit when vLLM evicts it. Event batches are shaped as vLLM 0.32's
connector sends them (``docs/real-vllm-offload.md``): GPU stores per group at schedule time,
one CPU ``BlockStored`` per chunk a batch later naming only the chunk's last hash."""

from __future__ import annotations

import json

import pytest
from routerkit import batch, removed, stored

from events.codec import decode_batch, encode_batch
from events.structs import BlockStored
from router.decision.chunking import ChunkLearner
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.score import Score, Scorer
from router.fleet.specs import CpuChunk, parse_instance
from router.index import MemoryIndex, Tier, slot_of
from router.prediction.speculative import SpeculativeResidency

BS = 32
G0, C0 = slot_of(0, Tier.GPU), slot_of(0, Tier.CPU)


def chain(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def gpu_store(
    hashes: list[int],
    parent: int | None = None,
    group: int = 0,
    kind: str = "full_attention",
    window: int | None = None,
) -> BlockStored:
    return stored(hashes, group, "GPU", block_size=BS, kind=kind, window=window, parent=parent)


def placeholder(h: int, group: int = 0) -> BlockStored:
    """vLLM's default CPU event: the chunk's last hash, no parent, no tokens, size 0."""
    return stored([h], group, "CPU", block_size=0)


def self_describing(hashes: list[int], parent: int | None, group: int = 0) -> BlockStored:
    return stored(hashes, group, "CPU", block_size=BS, kind="full_attention", parent=parent)


# ---- the instance's --kv-transfer-config ---------------------------------------------------


def _transfer(**extra: object) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "X", "cpu_bytes_to_use": 1 << 23, **extra},
        }
    )


def test_kv_transfer_config_gives_the_chunk_in_both_instance_forms():
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})
    spec = parse_instance(
        f"http://h:8000={events},kv_transfer_config={_transfer(blocks_per_chunk=2)},model=m"
    )
    assert spec.cpu_chunk == CpuChunk(blocks=2) and spec.models == ("m",)
    assert spec.events == "tcp://h:5557"
    legacy = parse_instance(
        f"http://h:8000=tcp://h:5557,kv_transfer_config={_transfer(block_size=128)},topic=t"
    )
    assert legacy.cpu_chunk == CpuChunk(tokens=128) and legacy.topic == "t"
    # vLLM's default when the connector is on and neither key is given: one block.
    default = parse_instance(f"http://h:8000=tcp://h:1,kv_transfer_config={_transfer()}")
    assert default.cpu_chunk == CpuChunk(blocks=1)
    other = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    assert parse_instance(f"http://h:8000=tcp://h:1,kv_transfer_config={other}").cpu_chunk is None


@pytest.mark.parametrize(
    "extra",
    [{"blocks_per_chunk": 2, "block_size": 64}, {"blocks_per_chunk": 0}, {"block_size": "64"}],
)
def test_a_kv_transfer_config_vllm_would_refuse_is_a_clear_error(extra):
    with pytest.raises(ValueError, match="block"):
        parse_instance(f"http://h:8000=tcp://h:1,kv_transfer_config={_transfer(**extra)}")
    with pytest.raises(ValueError, match="JSON"):
        parse_instance("http://h:8000=tcp://h:1,kv_transfer_config={nope")


# ---- learning the chunk size ---------------------------------------------------------------


def test_placeholders_placed_in_gpu_chains_give_the_chunk_size():
    learner = ChunkLearner()
    hs = chain(7)
    # Prefill in two scheduled chunks: the second store names its parent.
    assert not learner.observe(batch(gpu_store(hs[:4]), gpu_store(hs[4:], parent=hs[3])))
    # Two blocks per chunk: keys are blocks 1, 3, 5 (ends 64, 128, 192 tokens).
    assert learner.observe(batch(placeholder(hs[3]), placeholder(hs[1]), placeholder(hs[5])))
    assert learner.tokens_per_chunk == 2 * BS
    # Placeholders of hashes never announced on the GPU (before we listened) are skipped.
    assert not learner.observe(batch(placeholder(99)))
    assert learner.tokens_per_chunk == 2 * BS


def test_the_first_placeholder_alone_may_overestimate_until_chunk_zero_comes():
    learner = ChunkLearner(settle_after=3)
    hs = chain(8)
    learner.observe(batch(gpu_store(hs)))
    learner.observe(batch(placeholder(hs[3])))  # chunk 1 of 2-block chunks: ends at 128
    assert learner.tokens_per_chunk == 4 * BS
    learner.observe(batch(placeholder(hs[1])))
    assert learner.tokens_per_chunk == 2 * BS
    for h in (hs[5], hs[7], hs[3]):
        learner.observe(batch(placeholder(h)))
    assert learner.settled and learner.tokens_per_chunk == 2 * BS
    assert not learner.observe(batch(gpu_store(chain(4, 5000)), placeholder(5000)))  # settled


def test_the_tracked_chains_stay_bounded_and_a_chain_spanning_two_generations_still_places():
    """Up to ``max_tracked`` hashes (plus one store's) in two generations: the older goes
    whole when the newer holds half; a chain whose start went to the older one extends."""
    learner = ChunkLearner(max_tracked=8)
    learner.observe(batch(placeholder(1)))  # a CPU tier: chains are placed from now on
    first = chain(3)
    learner.observe(batch(gpu_store(first)))  # 3 tracked (newest generation)
    rest = chain(3, 9000)
    learner.observe(batch(gpu_store(rest[:2], parent=first[2])))  # 5 >= 4: a new generation
    assert len(learner._ends) == 0 and len(learner._older) == 5
    learner.observe(batch(gpu_store(rest[2:], parent=rest[1])))  # parent in the older one
    assert learner._ends == {rest[2]: 6 * BS}
    assert learner.observe(batch(placeholder(first[1]), placeholder(rest[2])))  # ends 2, 6
    assert learner.tokens_per_chunk == 2 * BS
    for k in range(10):  # many chains later: never over max_tracked
        learner.observe(batch(gpu_store(chain(3, 20_000 + 10 * k))))
        assert len(learner._ends) + len(learner._older) <= 8 + 3


def test_without_a_placeholder_gpu_stores_are_only_remembered_then_placed_at_the_first():
    """An instance with no CPU tier costs the learner one append per GPU store, bounded by
    ``recent_hashes``; the first placeholder places the remembered stores, then itself."""
    learner = ChunkLearner(recent_hashes=6)
    old = chain(4, 5000)
    learner.observe(batch(gpu_store(old)))
    hs = chain(6)
    learner.observe(batch(gpu_store(hs[:3]), gpu_store(hs[3:], parent=hs[2])))
    assert not learner.placing and learner._ends == {} and learner._older == {}
    assert [len(r[1]) for r in learner._recent] == [3, 3]  # the oldest store went
    assert learner.observe(batch(placeholder(hs[1]), placeholder(hs[5])))  # ends 2 and 6
    assert learner.placing and learner.tokens_per_chunk == 2 * BS and not learner._recent
    assert not learner.observe(batch(placeholder(old[1])))  # forgotten: not placed
    learner.observe(batch(gpu_store(chain(3, 7000))))  # placing now: placed as they come
    assert learner._ends[7002] == 3 * BS


def test_window_and_mamba_stores_do_not_place_hashes():
    learner = ChunkLearner()
    hs = chain(6)
    # A window group names only the blocks it retains: positions cannot be read from it.
    learner.observe(batch(gpu_store([hs[4], hs[5]], kind="sliding_window", window=64, group=1)))
    assert not learner.observe(batch(placeholder(hs[5], group=1)))
    learner.observe(batch(gpu_store(hs)))
    assert learner.observe(batch(placeholder(hs[5], group=1), placeholder(hs[2], group=2)))
    assert learner.tokens_per_chunk == 3 * BS  # ends 192 and 96


@pytest.mark.parametrize("form", ["map", "array"])
def test_placeholders_of_both_vllm_releases_decode_and_teach_the_same(form):
    # vLLM 0.33 with self-describing events on: window / Mamba placeholders name their
    # group's kind and window (OffloadingEventsTracker._placeholder_stored); 0.32 sends
    # None. Both decode, and the router learns the same from either: it reads a
    # placeholder's hash and group only (docs/vllm-0.32-vs-0.33.md row 20).
    hs = chain(6)
    gpu = batch(
        gpu_store(hs),
        gpu_store([hs[4], hs[5]], group=1, kind="sliding_window", window=64),
    )
    v032 = [placeholder(hs[5], group=1), placeholder(hs[2], group=0)]
    v033 = [
        stored([hs[5]], 1, "CPU", block_size=0, kind="sliding_window", window=64),
        stored([hs[2]], 0, "CPU", block_size=0, kind="full_attention"),
    ]
    learned = []
    for events in (v032, v033):
        decoded = decode_batch(encode_batch(batch(*events), form))
        assert [
            (e.block_hashes, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in decoded.events
        ] == [
            (e.block_hashes, e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
            for e in events
        ]
        learner, reg = ChunkLearner(), LayoutRegistry()
        learner.observe(gpu)
        reg.observe("a", gpu)
        learner.observe(decoded)
        reg.observe("a", decoded)
        learned.append((learner.tokens_per_chunk, reg.get("a")))
    assert learned[0] == learned[1]
    assert learned[0][0] == 3 * BS and learned[0][1] is not None  # ends 192 and 96


def _cpu_scenario(reg: LayoutRegistry, name: str = "a", *, self_desc: bool = False) -> list[int]:
    hs = chain(8)
    b1 = batch(gpu_store(hs))
    if self_desc:
        b2 = batch(
            *(
                self_describing(hs[c * 2 : c * 2 + 2], hs[c * 2 - 1] if c else None)
                for c in range(4)
            )
        )
    else:
        b2 = batch(*(placeholder(hs[c * 2 + 1]) for c in range(4)))
    reg.observe(name, b1)
    reg.observe(name, b2)
    return hs


@pytest.mark.parametrize("self_desc", [False, True])
def test_chunk_size_precedence_configured_then_learned_then_default(self_desc):
    reg = LayoutRegistry()
    _cpu_scenario(reg, "a", self_desc=self_desc)
    got = reg.get("a")
    assert got is not None and got.tokens_per_chunk == 2 * BS
    want = "self-describing" if self_desc else "placeholder CPU events' places"
    assert want in reg.chunk_source("a")
    reg.configure_chunk("a", blocks=4)
    got = reg.get("a")
    assert got is not None and got.tokens_per_chunk == 4 * BS
    assert reg.chunk_source("a") == "configured: kv_transfer_config blocks_per_chunk=4"
    reg.configure_chunk("a", tokens=3 * BS)
    assert reg.get("a").tokens_per_chunk == 3 * BS  # type: ignore[union-attr]
    reg.configure_chunk("a")
    assert reg.get("a").tokens_per_chunk == 2 * BS  # type: ignore[union-attr]
    # GPU events only: vLLM's default, one block per chunk.
    reg.observe("b", batch(gpu_store(chain(3, 7000))))
    assert reg.get("b").tokens_per_chunk is None  # type: ignore[union-attr]
    assert reg.chunk_source("b") == "default: one block per chunk (vLLM's default)"
    # A restarted instance (forgotten) learns again.
    reg.forget("a")
    assert "a" not in reg._placed and reg.learned("a") is None


def test_self_describing_events_stop_the_placeholder_learner_and_its_table():
    """Self-describing CPU events name the chunk size: the placeholder learner's hash ->
    end table (up to 64k entries per instance) is dropped, and GPU chains no longer
    fill it."""
    reg = LayoutRegistry()
    hs = chain(8)
    reg.observe("a", batch(gpu_store(hs[:4])))
    assert reg._placed["a"]._recent  # stores are remembered until the size is known
    reg.observe("a", batch(gpu_store(hs[4:], parent=hs[3]), self_describing(hs[:2], None)))
    reg.observe("a", batch(gpu_store(chain(64, 9000))))
    learner = reg._placed["a"]
    assert learner._ends == {} and not learner._recent and learner.settled
    assert reg.get("a").tokens_per_chunk == 2 * BS  # type: ignore[union-attr]


async def test_placeholder_cpu_hits_at_two_blocks_per_chunk_are_scored_once_learned():
    # The case: vLLM served 512 tokens from CPU, the router predicted 0.
    index, reg = MemoryIndex(), LayoutRegistry()
    hs = chain(8)
    b1 = batch(gpu_store(hs))
    b2 = batch(*(placeholder(hs[c * 2 + 1]) for c in range(4)))
    b3 = batch(*(removed([h]) for h in reversed(hs)))  # the GPU pool evicts them all
    for b in (b1, b2, b3):
        reg.observe("a", b)
        await index.apply("a", b)
    scorer = Scorer(index, reg)
    prompt = 8 * BS + 5
    assert await scorer.score(hs, prompt, ["a"]) == {"a": Score(0, 8 * BS)}
    # Read at one block per chunk (what the router assumed before) the same events give 0.
    one = Scorer(index, LayoutRegistry(configured={"a": InstanceLayout.full(BS)}))
    assert await one.score(hs, prompt, ["a"]) == {"a": Score(0, 0)}


def test_debug_chunk_keys_count_chunks_by_their_last_block():
    from router.decision.explain import _chunk_info, _chunk_keys

    layout = InstanceLayout.full(BS, tokens_per_chunk=2 * BS)
    assert _chunk_keys(0b1010_1010, layout) == 4
    assert _chunk_keys(0b0101_0101, layout) == 0  # blocks without their chunk's key
    info = _chunk_info(layout, "configured")
    assert info == {"tokens_per_chunk": 64, "blocks_per_chunk": 2, "source": "configured"}
    assert _chunk_info(InstanceLayout.full(BS), "default")["blocks_per_chunk"] == 1  # type: ignore[index]


# ---- predict-on-route ends with vLLM's eviction -------------------------------------------


def test_a_gpu_eviction_ends_the_speculative_credit_of_that_block_in_that_group():
    spec = SpeculativeResidency(ttl_s=60.0)
    hs = chain(6)
    g1 = slot_of(1, Tier.GPU)
    h = spec.record("a", {0: hs, 1: hs[4:]}, whole=0b01)  # full attention + a window tail
    assert spec.residency(hs, ["a"]) == {"a": {G0: 0b111111, g1: 0b110000}}
    # While its longer prompt ran, vLLM evicted the window tail's first block and a
    # full-attention block: neither is credited any more (the CPU tier, if it holds them,
    # comes from the index).
    spec.observe("a", batch(removed([hs[4]], 1), removed([hs[2]], 0), removed([hs[4]], 0, "CPU")))
    assert spec.residency(hs, ["a"]) == {"a": {G0: 0b111011, g1: 0b100000}}
    # Evictions of blocks nobody recorded, or on other instances, change nothing.
    spec.observe("b", batch(removed([hs[0]], 0)))
    spec.observe("a", batch(removed([12345], 0)))
    assert spec.residency(hs, ["a"]) == {"a": {G0: 0b111011, g1: 0b100000}}
    spec.settle("a", h)
    spec.flush("a")
    assert spec.residency(hs, ["a"]) == {} and not spec._evicted  # nothing left to mask
    h2 = spec.record("a", {0: hs}, whole=0b1)
    assert spec.residency(hs, ["a"]) == {"a": {G0: 0b111111}}  # a new record is credited
    spec.release("a", h2)


def test_ingest_tells_predict_on_route_of_gpu_evictions_before_the_batch_applies():
    """The wiring: ingest's listener (``PredictOnRoute.batch_learned``) ends the credit."""
    from router.config import RouterSettings
    from router.state import RouterState

    state = RouterState(RouterSettings(policy="cost"))
    assert state.ingest.listener is state.prediction
    store = state.prediction.store
    hs = chain(4)
    h = store.record("a", {0: hs}, whole=0b1)
    assert store.residency(hs, ["a"]) == {"a": {G0: 0b1111}}
    state.prediction.batch_learned("a", batch(removed([hs[1]], 0)))
    assert store.residency(hs, ["a"]) == {"a": {G0: 0b1101}}
    store.release("a", h)


def test_the_speculative_group_classes_follow_real_layouts():
    # Gemma-3-like: 5 window groups share one class; Qwen3-Next-like: 3 Mamba groups.
    spec = SpeculativeResidency(ttl_s=60.0)
    hs = chain(4)
    groups = {g: hs[3:] for g in range(5)} | {5: hs}
    spec.record("a", groups, whole=1 << 5)
    spec.observe("a", batch(removed([hs[3]], 2)))
    res = spec.residency(hs, ["a"])["a"]
    assert res[slot_of(2, Tier.GPU)] == 0 and res[slot_of(1, Tier.GPU)] == 0b1000
    assert res[slot_of(5, Tier.GPU)] == 0b1111
