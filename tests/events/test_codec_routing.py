"""Decoding for routing (``decode_batch(..., token_ids=False)``): the same batch as a full
decode, with the token id fields never built -- in every wire form vLLM has used."""

from __future__ import annotations

import msgspec
import pytest

from events.codec import DecodeError, decode_batch, encode_batch
from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def _stored(**kw) -> BlockStored:
    base = dict(
        block_hashes=[1, 2**64 - 1, 2**63], parent_block_hash=7, token_ids=list(range(48)),
        block_size=16, lora_id=3, medium="CPU", lora_name="ad", extra_keys=[("salt",), None],
        group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
        locality="local", ownership="owned", session_id="s", lookahead_token_ids=[[1, 2]],
    )  # fmt: skip
    return BlockStored(**{**base, **kw})


def _sans_tokens(batch: KVEventBatch) -> KVEventBatch:
    events = [
        msgspec.structs.replace(e, token_ids=[], lookahead_token_ids=None)
        if type(e) is BlockStored
        else e
        for e in batch.events
    ]
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


BATCHES = [
    KVEventBatch(
        ts=1.5,
        events=[
            _stored(),
            BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0),
            AllBlocksCleared(),
            _stored(parent_block_hash=None, lookahead_token_ids=None),
        ],
        data_parallel_rank=2,
    ),
    KVEventBatch(ts=2.0, events=[]),
]


@pytest.mark.parametrize("form", ["map", "array"])
@pytest.mark.parametrize("batch", BATCHES)
def test_routing_decode_equals_the_full_decode_without_token_ids(batch, form):
    payload = encode_batch(batch, form)
    full = decode_batch(payload)
    light = decode_batch(payload, token_ids=False)
    assert light == _sans_tokens(full)
    assert all(type(e) in (BlockStored, BlockRemoved, AllBlocksCleared) for e in light.events)
    if form == "map":
        assert full == batch  # and the full decode still keeps them


def test_routing_decode_skips_unknown_event_types_and_fields_like_the_full_decode():
    payload = msgspec.msgpack.encode(
        [3.0, [{"type": "BlockPinned", "x": 1},
               {"type": "BlockRemoved", "block_hashes": [9], "medium": None, "new": [1]}], None]
    )  # fmt: skip
    assert decode_batch(payload, token_ids=False) == decode_batch(payload)
    assert decode_batch(payload, token_ids=False).events == [
        BlockRemoved(block_hashes=[9], medium=None)
    ]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}], None]),
        msgspec.msgpack.encode(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "parent_block_hash": None,
                        "token_ids": [],
                        "block_size": 16,
                        "lora_id": None,
                        "medium": None,
                        "lora_name": None,
                        "group_idx": "a",
                    }
                ],
                None,
            ]
        ),
        msgspec.msgpack.encode({"ts": 1}),
    ],
)
def test_routing_decode_refuses_what_the_full_decode_refuses(payload):
    with pytest.raises(DecodeError):
        decode_batch(payload)
    with pytest.raises(DecodeError):
        decode_batch(payload, token_ids=False)
