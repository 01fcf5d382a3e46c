"""``kvroute events ...``: look at a live vLLM KV event stream.

``tail`` prints one JSON object per event, per line, so its output can be piped into
``jq`` or saved and diffed. Imports only ``events`` (never torch).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from typing import Any

import msgspec
import typer

app = typer.Typer(no_args_is_help=True)

_json = msgspec.json.Encoder()


def _plain(value: Any) -> Any:
    """JSON-safe value: bytes (raw-digest hashes) as hex, everything else as builtins."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return msgspec.to_builtins(value, builtin_types=(bytes, bytearray, memoryview))


def item_lines(item: Any) -> list[dict[str, Any]]:
    """The output objects for one subscriber item (one per event for a batch)."""
    from events.subscriber import BatchesMissed, BatchReceived, SourceRestarted

    if isinstance(item, BatchReceived):
        head = {
            "seq": item.seq,
            "ts": item.batch.ts,
            "data_parallel_rank": item.batch.data_parallel_rank,
            "replayed": item.replayed,
        }
        lines = []
        for event in item.batch.events:
            fields = {f: _plain(getattr(event, f)) for f in event.__struct_fields__}
            lines.append({**head, "type": type(event).__name__, **fields})
        return lines
    if isinstance(item, SourceRestarted):
        return [{"type": "SourceRestarted", "last_seq": item.last_seq, "new_seq": item.new_seq}]
    if isinstance(item, BatchesMissed):
        return [{"type": "BatchesMissed", "first_seq": item.first_seq, "last_seq": item.last_seq}]
    raise TypeError(f"unexpected subscriber item {item!r}")


async def _tail(
    endpoint: str,
    replay: str | None,
    from_seq: int | None,
    topic: str,
    count: int | None,
    timeout: float | None,
) -> dict[str, Any]:
    from events.subscriber import ZmqEventSubscriber

    events = 0
    sub = ZmqEventSubscriber(endpoint, replay, topic, start_seq=from_seq, name="tail")
    try:
        async with asyncio.timeout(timeout):
            async for item in sub:
                for line in item_lines(item):
                    sys.stdout.write(_json.encode(line).decode() + "\n")
                    if line["type"] in ("SourceRestarted", "BatchesMissed"):
                        continue
                    events += 1
                    if count is not None and events >= count:
                        break
                sys.stdout.flush()
                if count is not None and events >= count:
                    break
    except TimeoutError:
        pass
    finally:
        await sub.close()
    return {"events": events, **dataclasses.asdict(sub.stats)}


@app.command("tail")
def tail(
    endpoint: str = typer.Argument(..., help="Publisher endpoint, e.g. tcp://127.0.0.1:5557."),
    replay: str | None = typer.Option(
        None, "--replay", help="Publisher replay endpoint: heal gaps, allow --from-seq."
    ),
    from_seq: int | None = typer.Option(
        None, "--from-seq", min=0, help="Replay from this seq first, then follow live."
    ),
    topic: str = typer.Option("", "--topic", help="Topic prefix to subscribe to."),
    count: int | None = typer.Option(None, "--count", min=1, help="Stop after N events."),
    timeout: float | None = typer.Option(
        None, "--timeout", min=0.0, help="Stop after S seconds in total."
    ),
) -> None:
    """Print a KV event stream as JSON lines: one per event, plus restart/missed markers."""
    summary: dict[str, Any] | None = None
    try:
        summary = asyncio.run(_tail(endpoint, replay, from_seq, topic, count, timeout))
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # Reader went away (e.g. `| head`): point stdout at /dev/null so the
        # interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    if summary is not None:
        sys.stderr.write(_json.encode(summary).decode() + "\n")
