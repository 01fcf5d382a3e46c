"""Encode and decode KV event batches in vLLM's current (map) and legacy (array) forms.

Decoding is tolerant by design: a subscriber sees payloads from many vLLM generations
(5-field v0.9 ``BlockStored`` arrays up to the 0.33 map form with ``session_id``), so the
fast typed decoder handles the current form and a normaliser handles everything else.
Anything that cannot be made sense of raises ``DecodeError`` -- never another exception --
so a consumer can count it and move on.

``token_ids=False`` decodes for routing: a ``BlockStored``'s ``token_ids`` and
``lookahead_token_ids`` are skipped over, never built (they come back ``[]`` and ``None``;
``token_ids`` must still be present, though any msgpack value passes: routing never reads
it). A consumer that never recomputes hashes from tokens reads nothing
else of them, and they are most of a decoded batch (16 ints per block: ~12x the wire
size).
"""

from __future__ import annotations

from typing import Any, Literal, cast

import msgspec

from events.structs import (
    ARRAY_TWINS,
    EVENT_TYPES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVEvent,
    KVEventBatch,
)

__all__ = ["DecodeError", "decode_batch", "encode_batch"]


class DecodeError(ValueError):
    """A payload that is not a KV event batch of any known vLLM form."""


_encoder = msgspec.msgpack.Encoder()
_map_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_raw_decoder = msgspec.msgpack.Decoder()


class _StoredSansTokens(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    """``BlockStored`` as routing reads it: the token id fields are skipped over as raw
    msgpack (``msgspec.Raw``: located, never turned into objects). Same names and
    requirements as ``BlockStored``; ``_full`` builds the real struct."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: msgspec.Raw | None = None

    def _full(self) -> BlockStored:
        return BlockStored(
            block_hashes=self.block_hashes,
            parent_block_hash=self.parent_block_hash,
            token_ids=[],
            block_size=self.block_size,
            lora_id=self.lora_id,
            medium=self.medium,
            lora_name=self.lora_name,
            extra_keys=self.extra_keys,
            group_idx=self.group_idx,
            kv_cache_spec_kind=self.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=self.kv_cache_spec_sliding_window,
            locality=self.locality,
            ownership=self.ownership,
            session_id=self.session_id,
        )


class _BatchSansTokens(EventBatch):
    events: list[_StoredSansTokens | BlockRemoved | AllBlocksCleared]


_routing_decoder = msgspec.msgpack.Decoder(_BatchSansTokens)

# Positional field names per event type, in vLLM's order (the legacy array layout).
_FIELDS: dict[str, tuple[str, ...]] = {
    name: tuple(f.name for f in msgspec.structs.fields(cls)) for name, cls in EVENT_TYPES.items()
}
# Fields without a default that older producers did not send.
_NULLABLE_REQUIRED: dict[str, tuple[str, ...]] = {
    "BlockStored": ("parent_block_hash", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("medium",),
}
_REQUIRED: dict[str, int] = {
    # Legacy arrays may stop early; v0.9 BlockStored had 5 fields, early BlockRemoved 1.
    "BlockStored": 4,
    "BlockRemoved": 1,
    "AllBlocksCleared": 0,
}


def encode_batch(batch: KVEventBatch, form: Literal["map", "array"] = "map") -> bytes:
    """Serialise ``batch`` exactly as vLLM's ``msgspec.msgpack.Encoder`` would."""
    if form == "map":
        return _encoder.encode(batch)
    if form == "array":
        events = [ARRAY_TWINS[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
        return _encoder.encode([batch.ts, events, batch.data_parallel_rank])
    raise ValueError(f"unknown event form {form!r}; expected 'map' or 'array'")


def decode_batch(payload: bytes, *, token_ids: bool = True) -> KVEventBatch:
    """Decode a batch in any known form; unknown fields and event types are ignored.
    ``token_ids=False``: the same batch with every ``BlockStored``'s ``token_ids`` ``[]``
    and ``lookahead_token_ids`` None, never built (module docstring)."""
    try:
        if token_ids:
            return _map_decoder.decode(payload)
        light = _routing_decoder.decode(payload)
        sans = _StoredSansTokens
        events: list[Any] = [ev._full() if type(ev) is sans else ev for ev in light.events]
        return KVEventBatch(light.ts, events, light.data_parallel_rank)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    except Exception as exc:  # msgspec can raise e.g. RecursionError on hostile input
        raise DecodeError(f"undecodable payload: {exc}") from exc
    try:
        raw = _raw_decoder.decode(payload)
    except Exception as exc:
        raise DecodeError(f"not msgpack: {exc}") from exc
    batch = _normalise_batch(raw)
    if not token_ids:
        for ev in batch.events:
            if type(ev) is BlockStored:
                ev.token_ids, ev.lookahead_token_ids = [], None
    return batch


def _normalise_batch(raw: Any) -> KVEventBatch:
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError("batch must be an array [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise DecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise DecodeError("batch events must be an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise DecodeError("data_parallel_rank must be an int or nil")
    out = [ev for ev in map(_normalise_event, events) if ev is not None]
    return KVEventBatch(ts=float(ts), events=out, data_parallel_rank=rank)


def _normalise_event(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise DecodeError(f"event type must be a string, got {type(kind).__name__}")
        if kind not in EVENT_TYPES:
            return None  # a newer vLLM's event type: skip it, keep the batch
        fields = {k: raw.get(k) for k in _FIELDS[kind] if k in raw}
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        if not isinstance(kind, str):
            raise DecodeError(f"event tag must be a string, got {type(kind).__name__}")
        if kind not in EVENT_TYPES:
            return None
        values = raw[1:]
        if len(values) < _REQUIRED[kind]:
            raise DecodeError(f"{kind} array has {len(values)} fields, needs {_REQUIRED[kind]}")
        fields = dict(zip(_FIELDS[kind], values, strict=False))
    else:
        raise DecodeError(f"event must be a map or a tagged array, got {type(raw).__name__}")
    return _build(kind, fields)


def _build(kind: str, fields: dict[str, Any]) -> KVEvent:
    cls = EVENT_TYPES[kind]
    for name in _NULLABLE_REQUIRED.get(kind, ()):
        fields.setdefault(name, None)  # absent in old forms; vLLM's value then was None
    fields["type"] = kind
    try:
        return cast("KVEvent", msgspec.convert(fields, cls))  # cls: one of KVEvent's members
    except msgspec.ValidationError as exc:
        raise DecodeError(f"bad {kind} event: {exc}") from exc
