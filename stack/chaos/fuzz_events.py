"""Scenario: garbage on the event wire (msgpack payload generators and the fuzz run)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

from stack.chaos.results import FuzzEventsResult
from stack.procs import LOOPBACK, free_port

_INSANE_INTS = [-1, -(2**63), 2**31, 10**12, 2**63 - 1, 2**64 - 1]
_INSANE_TS = [float("nan"), float("inf"), -float("inf"), 1e300, -1.0, 0.0, 4e9]


def _valid_batch_objects(rng: random.Random, insane: bool = False) -> Any:
    """A well-formed batch; ``insane``: well-typed but absurd values (timestamps far in
    the future or NaN, negative or huge group indexes and block sizes, odd media)."""
    from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    def odd(normal: list[Any], extra: list[Any]) -> Any:
        return rng.choice(extra) if insane and rng.random() < 0.3 else rng.choice(normal)

    events: list[Any] = []
    for _ in range(rng.randrange(0, 5)):
        r = rng.random()
        hashes = [rng.randrange(1 << 64) for _ in range(rng.randrange(0, 6))]
        group = odd([None, 0, 1, 2], _INSANE_INTS)
        medium = odd([None, "GPU", "CPU", "STORAGE"], ["", "gpu", "\x00", "DISK" * 50])
        if r < 0.6:
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=rng.choice([None, rng.randrange(1 << 64)]),
                    token_ids=[rng.randrange(1000) for _ in range(rng.choice([0, 16]))],
                    block_size=odd([0, 16, 32], [*_INSANE_INTS, 3]),
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=group,
                    kv_cache_spec_kind=odd(
                        [None, "full_attention", "sliding_window", "mamba"], ["", "attention?"]
                    ),
                    kv_cache_spec_sliding_window=odd([None, 64], [0, *_INSANE_INTS]),
                )
            )
        elif r < 0.95:
            events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
        else:
            events.append(AllBlocksCleared())
    ts = odd([time.time()], _INSANE_TS)
    return KVEventBatch(ts=ts, events=events, data_parallel_rank=rng.choice([None, 0]))


_ODD = [None, True, False, 0, -1, 1, 16, 2**63, 2**64 - 1, -(2**63), 10**12, 1.5, -0.0]
_ODD += [float("nan"), float("inf"), 1e300, "", "GPU", "CPU", "BlockStored", "BlockRemoved"]
_ODD += ["AllBlocksCleared", "sliding_window", "mamba", "full_attention", b"", b"\x00" * 8]
_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
_FIELDS += ["medium", "lora_name", "group_idx", "kv_cache_spec_kind"]
_FIELDS += ["kv_cache_spec_sliding_window", "extra_keys", "session_id"]


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.55:
        return rng.choice(_ODD) if rng.random() < 0.7 else rng.randrange(-(2**63), 2**64)
    if r < 0.8:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    keys = [*_FIELDS, 1, "x"]
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(6))}


def _near_valid(rng: random.Random) -> Any:
    """Batch-shaped structures with the wrong types in random places."""
    events: list[Any] = []
    for _ in range(rng.randrange(5)):
        kind = rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", _random_value(rng)])
        values = [
            _random_value(rng, 2) if rng.random() < 0.4 else rng.choice(_ODD)
            for _ in range(rng.randrange(15))
        ]
        if rng.random() < 0.5:
            events.append({"type": kind, **dict(zip(_FIELDS[1:], values, strict=False))})
        else:
            events.append([kind, *values])
    batch = [rng.choice([time.time(), 0, -1.0, 1e300, float("nan"), "ts"]), events]
    if rng.random() < 0.7:
        batch.append(rng.choice([None, 0, 3, "rank", 2**64 - 1]))
    return batch


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 5)):
        op = rng.randrange(6)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip bits
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:  # truncate
            del b[pos:]
        elif op == 2:  # insert random bytes
            b[pos:pos] = rng.randbytes(rng.randrange(1, 9))
        elif op == 3 and b:  # delete a slice
            del b[pos : pos + rng.randrange(1, 9)]
        elif op == 4:  # a msgpack marker that lies about what follows
            b[pos:pos] = bytes([rng.choice([0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xDB, 0xC6, 0xCB])])
            b[pos + 1 : pos + 1] = rng.randbytes(4)
        else:  # duplicate a slice
            b[pos:pos] = b[pos : pos + rng.randrange(1, 17)]
    return bytes(b)


def random_payloads(n: int, seed: int = 0) -> list[bytes]:
    """``n`` payloads: mutated valid batches (map and array forms), random msgpack values,
    batch-shaped structures with wrong types, raw bytes and a few hostile classics."""
    import msgspec

    from events.codec import encode_batch

    rng = random.Random(seed)
    out: list[bytes] = [
        b"",
        b"\xc1",
        b"\x91" * 100_000 + b"\xc0",  # nesting deeper than any decoder's stack
        b"\xdd\xff\xff\xff\xff",  # an array header promising 4 billion items
        b"\xdb\xff\xff\xff\xff",  # a str header promising 4 GiB
        b"\x93\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00\x90\xc0",  # ts = +inf
        b"\x93\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00\x90\xc0",  # ts = NaN
    ]
    while len(out) < n:
        r = rng.random()
        if r < 0.45:
            form = "map" if rng.random() < 0.7 else "array"
            out.append(mutate(rng, encode_batch(_valid_batch_objects(rng), form)))
        elif r < 0.6:
            out.append(msgspec.msgpack.encode(_random_value(rng)))
        elif r < 0.85:
            out.append(msgspec.msgpack.encode(_near_valid(rng)))
        elif r < 0.9:
            out.append(encode_batch(_valid_batch_objects(rng), rng.choice(["map", "array"])))
        elif r < 0.95:
            insane = _valid_batch_objects(rng, insane=True)
            out.append(encode_batch(insane, rng.choice(["map", "array"])))
        else:
            out.append(rng.randbytes(rng.randrange(64)))
    return out[:n]


def hypothesis_payloads(n: int, seed: int = 0) -> list[bytes]:
    """``n`` structure-aware payloads generated by hypothesis (edge-biased values in
    batch-shaped msgpack, both event forms, and mutations of encoded batches)."""
    import msgspec
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    scalar = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**63), max_value=2**64 - 1)
        | st.floats()
        | st.text(max_size=12)
        | st.binary(max_size=12)
        | st.sampled_from(_ODD)
    )
    value = st.recursive(scalar, lambda c: st.lists(c, max_size=4), max_leaves=8)
    name = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]) | scalar
    as_map = st.builds(
        lambda k, fields: {"type": k, **fields},
        name,
        st.dictionaries(st.sampled_from(_FIELDS[1:]), value, max_size=6),
    )
    as_array = st.builds(lambda k, vals: [k, *vals], name, st.lists(value, max_size=12))
    batch = st.tuples(scalar, st.lists(as_map | as_array, max_size=3), scalar)
    encoded = batch.map(lambda b: msgspec.msgpack.encode(list(b))) | value.map(
        msgspec.msgpack.encode
    )
    mutated = st.tuples(encoded, st.integers(0, 2**32)).map(
        lambda t: mutate(random.Random(t[1]), t[0])
    )
    out: list[bytes] = []

    @hseed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(encoded | mutated)
    def collect(payload: bytes) -> None:
        out.append(payload)

    collect()
    return out


async def fuzz_events(
    payloads: list[bytes], *, transport: str = "inproc", chunk: int = 500
) -> FuzzEventsResult:
    """Publish every payload as one frame (contiguous seqs) into a real subscriber feeding
    ``IngestManager`` + ``MemoryIndex``, plus frames of the wrong shape; everything must
    be counted (a decoded batch or an undecodable one) and nothing may crash the feed.
    A valid marker batch closes each chunk; the last one must still reach the index."""
    import zmq
    from prometheus_client import CollectorRegistry

    from events.codec import encode_batch
    from events.structs import BlockStored, KVEventBatch
    from router.index import MemoryIndex
    from router.ingest import IngestManager

    if transport == "inproc":
        endpoint = f"inproc://kvroute-chaos-fuzz-{uuid.uuid4().hex}"
    else:
        endpoint = f"tcp://{LOOPBACK}:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    index, reg = MemoryIndex(), CollectorRegistry()
    mgr = IngestManager(index, registry=reg, heartbeat_s=None, cursor_check_s=None)
    name = "fuzzed"
    seq = 0

    def send(payload: bytes) -> int:
        nonlocal seq
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        return seq - 1

    def marker(block: int | None = None) -> int:
        events = [] if block is None else [BlockStored([block], None, [], 16, None, "GPU", None)]
        return send(encode_batch(KVEventBatch(ts=time.time(), events=events)))  # type: ignore[arg-type]

    def m(metric: str, **labels: str) -> float:
        return reg.get_sample_value(metric, {"instance": name, **labels}) or 0.0

    t0 = time.monotonic()
    try:
        await mgr.add_instance(name, endpoint)
        for _ in range(200):  # the subscription must reach the PUB before counting starts
            try:
                await mgr.wait_for_seq(name, marker(), timeout=0.05)
                break
            except TimeoutError:
                continue
        else:
            raise RuntimeError("fuzz subscriber never caught up")
        await asyncio.sleep(0.1)
        await mgr.wait_for_seq(name, marker(), timeout=10)
        base_batches = m("kvroute_ingest_batches_total", source="live")
        base_bad = m("kvroute_ingest_undecodable_total")
        markers = ignored = 0
        for i in range(0, len(payloads), chunk):
            for p in payloads[i : i + chunk]:
                send(p)
            # Each chunk ends with a real batch storing a new block. It is always handled;
            # it is not applied when garbage before it carried a ts slightly ahead of ours
            # (the index orders batches by (ts, seq)): counted, not a failure.
            block = 0xC0FFEE0000 + i
            await mgr.wait_for_seq(name, marker(block), timeout=60)
            markers += 1
            ignored += (await index.lookup([block], [name])).get(name) != {0: 1}
        shapes = [[b""], [b"", b"\x00" * 8], [b"", b"\x00" * 7, b"x"], [b"", b"", b"", b""]]
        for frames in shapes:
            pub.send_multipart(frames)
        last = marker()
        markers += 1
        await mgr.wait_for_seq(name, last, timeout=30)
        batches = m("kvroute_ingest_batches_total", source="live") - base_batches
        undecodable = int(m("kvroute_ingest_undecodable_total") - base_bad)
        injected = len(payloads) + len(shapes)
        decoded = int(batches) - markers
        invalid = sum(
            m("kvroute_ingest_events_total", type=t, status="invalid")
            for t in ("BlockStored", "BlockRemoved")
        )
        feed_errors = m("kvroute_ingest_errors_total")
    finally:
        await mgr.close()
        pub.close(0)
    return FuzzEventsResult(
        transport=transport,
        injected=injected,
        decoded=decoded,
        undecodable=undecodable,
        uncounted=injected - decoded - undecodable,
        invalid_events=invalid,
        feed_errors=feed_errors,
        markers=markers,
        markers_stale=ignored,
        wall_s=time.monotonic() - t0,
    )
