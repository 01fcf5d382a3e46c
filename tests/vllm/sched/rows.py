"""The offload differential's event rows, for vLLM's events (in the driver, vLLM's venv)
and for ours (in the tests): both have the same class names and fields, so one function
serves both sides. Imports nothing: the driver runs it beside vLLM."""

from __future__ import annotations

from typing import Any


def offload_rows(batches: list[Any]) -> list[list[Any]]:
    """Rows with the medium: per BlockStored event ``["stored_events", medium, group, kind,
    window, len(token_ids), block_size]``, per hash ``["stored" | "removed", medium, group,
    hash]``, other events ``[type]``."""
    rows: list[list[Any]] = []
    for batch in batches:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                rows.append(
                    [
                        "stored_events",
                        ev.medium,
                        ev.group_idx,
                        ev.kv_cache_spec_kind,
                        ev.kv_cache_spec_sliding_window,
                        len(ev.token_ids),
                        ev.block_size,
                    ]
                )
                rows += [["stored", ev.medium, ev.group_idx, h] for h in ev.block_hashes]
            elif kind == "BlockRemoved":
                rows += [["removed", ev.medium, ev.group_idx, h] for h in ev.block_hashes]
            else:
                rows.append([kind])
    return rows
