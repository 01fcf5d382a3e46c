"""Event encoding/decoding against vLLM 0.33's golden payloads, plus tolerance to bad input."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.codec import DecodeError, decode_batch, encode_batch
from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def _plain(obj: object) -> object:
    """Builtins with tuples as lists, for comparison with the JSON vectors."""
    return json.loads(json.dumps(msgspec.to_builtins(obj)))


def _cases(vectors: dict, form: str | None = None) -> list[dict]:
    return [b for b in vectors["batches"] if form is None or b["form"] == form]


def test_every_golden_payload_decodes_to_its_listed_values(event_batch_vectors):
    for case in _cases(event_batch_vectors):
        batch = decode_batch(bytes.fromhex(case["payload_hex"]))
        ts, events, rank = case["decoded"]
        assert batch.ts == ts and batch.data_parallel_rank == rank, case["name"]
        assert len(batch.events) == len(events), case["name"]
        for got, want in zip(batch.events, events, strict=True):
            got_d = _plain(got)
            if isinstance(want, list):  # legacy array form: compare positionally
                fields = [f.name for f in msgspec.structs.fields(type(got))]
                assert type(got).__name__ == want[0], case["name"]
                for name, value in zip(fields, want[1:], strict=False):
                    assert got_d.get(name) == value, (case["name"], name)
            else:
                for key, value in want.items():
                    assert got_d.get(key) == value, (case["name"], key)


def test_map_form_encoding_reproduces_golden_bytes(event_batch_vectors):
    cases = _cases(event_batch_vectors, "map")
    assert len(cases) >= 5
    for case in cases:
        payload = bytes.fromhex(case["payload_hex"])
        assert encode_batch(decode_batch(payload), form="map") == payload, case["name"]


def test_legacy_v09_block_stored_has_no_medium_or_group():
    payload = msgspec.msgpack.encode([9.0, [["BlockStored", [1], None, [0] * 16, 16, None]], None])
    (ev,) = decode_batch(payload).events
    assert isinstance(ev, BlockStored)
    assert ev.medium is None and ev.group_idx is None and ev.block_size == 16


def test_hash_above_2_63_survives_round_trip_as_uint64():
    big = (1 << 64) - 5
    batch = KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=[big], medium="GPU")])
    payload = encode_batch(batch)
    assert b"\xcf" in payload  # msgpack uint64
    assert decode_batch(payload).events[0].block_hashes == [big]


def test_bytes_hashes_decode_as_bytes_in_both_forms():
    ev = BlockStored([b"\x01" * 32], b"\x02" * 32, list(range(16)), 16, None, "GPU", None)
    batch = KVEventBatch(ts=2.0, events=[ev])
    for form in ("map", "array"):
        got = decode_batch(encode_batch(batch, form=form)).events[0]
        assert got.block_hashes == [b"\x01" * 32] and got.parent_block_hash == b"\x02" * 32


def test_unknown_fields_and_event_types_are_ignored():
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU", "future": 1},
                {"type": "SomethingNew", "x": 1},
                ["BlockRemoved", [8], "GPU", 2, None, None, "extra-trailing"],
            ],
            3,
        ]
    )
    batch = decode_batch(payload)
    assert [type(e) for e in batch.events] == [BlockRemoved, BlockRemoved]
    assert batch.events[0].block_hashes == [7] and batch.events[1].group_idx == 2
    assert batch.data_parallel_rank == 3


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93\xa1x\x90\xc0",  # ts is a string
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0, [["BlockStored", [1]]], None]),  # too few fields
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}], None]),
        msgspec.msgpack.encode([1.0, [42], None]),
        msgspec.msgpack.encode([1.0, {"a": 1}, None]),
        msgspec.msgpack.encode([1.0, [], "rank"]),
        b"\x91" * 5000,  # deep nesting
    ],
)
def test_garbage_raises_decode_error_only(payload):
    with pytest.raises(DecodeError):
        decode_batch(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_decode_error(data):
    try:
        result = decode_batch(data)
    except DecodeError as exc:
        assert str(exc)  # a message a log line can carry
    else:
        assert isinstance(result, KVEventBatch)


_hashes = st.lists(st.integers(0, (1 << 64) - 1) | st.binary(min_size=8, max_size=32), max_size=4)
_events = st.one_of(
    st.builds(
        BlockStored,
        block_hashes=_hashes,
        parent_block_hash=st.none() | st.integers(0, (1 << 64) - 1),
        token_ids=st.lists(st.integers(0, 1 << 20), max_size=32),
        block_size=st.sampled_from([16, 32]),
        lora_id=st.none() | st.integers(0, 9),
        medium=st.sampled_from(["GPU", "CPU", None]),
        lora_name=st.none() | st.text(max_size=5),
        group_idx=st.none() | st.integers(0, 3),
        kv_cache_spec_kind=st.sampled_from([None, "full_attention", "sliding_window", "mamba"]),
        kv_cache_spec_sliding_window=st.none() | st.integers(1, 4096),
    ),
    st.builds(
        BlockRemoved,
        block_hashes=_hashes,
        medium=st.sampled_from(["GPU", "CPU", None]),
        group_idx=st.none() | st.integers(0, 3),
    ),
    st.just(AllBlocksCleared()),
)


@settings(max_examples=200, deadline=None)
@given(
    ts=st.floats(0, 2e9, allow_nan=False),
    events=st.lists(_events, max_size=5),
    rank=st.none() | st.integers(0, 7),
    form=st.sampled_from(["map", "array"]),
)
def test_round_trip_in_both_forms(ts, events, rank, form):
    batch = KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)
    assert decode_batch(encode_batch(batch, form=form)) == batch


def test_unknown_form_is_rejected():
    with pytest.raises(ValueError, match="form"):
        encode_batch(KVEventBatch(ts=0.0, events=[]), form="xml")  # type: ignore[arg-type]
