"""``kvroute events tail`` as a user runs it: a subprocess against a real publisher."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from eventskit import make_batch

from events.publisher import ZmqEventPublisher
from events.structs import BlockStored, KVEventBatch

KVROUTE = str(Path(sys.executable).parent / "kvroute")


def tail(*args: str, log_level: str = "WARNING") -> subprocess.Popen:
    return subprocess.Popen(
        [KVROUTE, "--log-level", log_level, "events", "tail", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def publish_until_exit(proc: subprocess.Popen, pub: ZmqEventPublisher, start: int = 0) -> None:
    """Keep the stream moving (the CLI's SUB joins late) until the CLI exits."""
    deadline = time.monotonic() + 15
    n = start
    while proc.poll() is None and time.monotonic() < deadline:
        pub.publish(make_batch(n))
        n += 1
        time.sleep(0.02)


def lines_of(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    return [json.loads(line) for line in out.splitlines()]


def test_tail_prints_one_json_line_per_event_replayed_from_seq_0(ports):
    port, rport = ports
    with ZmqEventPublisher(
        endpoint=f"tcp://127.0.0.1:{port}", bind=True, replay_endpoint=f"tcp://127.0.0.1:{rport}"
    ) as pub:
        pub.publish(make_batch(0))
        pub.publish(make_batch(1))
        proc = tail(
            f"tcp://127.0.0.1:{port}",
            "--replay",
            f"tcp://127.0.0.1:{rport}",
            "--from-seq",
            "0",
            "--count",
            "6",
            "--timeout",
            "15",
        )
        lines = lines_of(proc)
    assert [(x["seq"], x["type"]) for x in lines] == [
        (0, "BlockStored"),
        (0, "BlockRemoved"),
        (0, "AllBlocksCleared"),
        (1, "BlockStored"),
        (1, "BlockRemoved"),
        (1, "AllBlocksCleared"),
    ]
    stored = lines[3]
    assert stored["replayed"] is True and stored["data_parallel_rank"] == 0
    assert stored["ts"] == 1.0
    assert stored["block_hashes"] == [1, 2**64 - 2]  # u64 hash ints survive as JSON ints
    assert stored["token_ids"] == [0, 1, 2, 3] and stored["group_idx"] == 0
    assert stored["parent_block_hash"] is None and stored["medium"] == "GPU"
    assert lines[4]["block_hashes"] == [1]


def test_tail_follows_the_live_stream_and_stops_after_count(ports):
    port, _ = ports
    with ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}", bind=True) as pub:
        proc = tail(f"tcp://127.0.0.1:{port}", "--count", "4", "--timeout", "15")
        publish_until_exit(proc, pub)
        lines = lines_of(proc)
    assert len(lines) == 4
    assert all(x["replayed"] is False for x in lines)
    first = lines[0]["seq"]
    assert [x["type"] for x in lines][:1] != ["BatchesMissed"]
    seqs = [x["seq"] for x in lines]
    assert seqs == sorted(seqs) and seqs[-1] - first <= 1


def test_tail_reports_the_missed_prefix_and_prints_bytes_hashes_as_hex(ports):
    port, _ = ports
    with ZmqEventPublisher(endpoint=f"tcp://127.0.0.1:{port}", bind=True) as pub:
        for i in range(3):
            pub.publish(make_batch(i))
        time.sleep(0.1)
        proc = tail(f"tcp://127.0.0.1:{port}", "--from-seq", "0", "--count", "1")
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            event = BlockStored(
                block_hashes=[b"\x01\xab"],
                parent_block_hash=b"\xff",
                token_ids=[1],
                block_size=1,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )
            pub.publish(KVEventBatch(ts=9.0, events=[event]))
            time.sleep(0.02)
        lines = lines_of(proc)
    missed, stored = lines
    assert missed["type"] == "BatchesMissed" and missed["first_seq"] == 0
    assert missed["last_seq"] == stored["seq"] - 1 >= 2
    assert stored["block_hashes"] == ["01ab"] and stored["parent_block_hash"] == "ff"


def test_tail_timeout_ends_the_run_cleanly_without_a_publisher(ports):
    t0 = time.monotonic()
    proc = tail(f"tcp://127.0.0.1:{ports[0]}", "--timeout", "1")
    assert lines_of(proc) == []
    assert time.monotonic() - t0 < 10


def test_tail_exits_cleanly_on_ctrl_c(ports):
    proc = tail(f"tcp://127.0.0.1:{ports[0]}", log_level="INFO")
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # past start-up: subscribed, waiting for batches
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        line = proc.stderr.readline() if ready else ""
        seen.append(line)
        if "subscribed" in line or proc.poll() is not None:
            break
    assert any("subscribed" in line for line in seen), seen
    proc.send_signal(signal.SIGINT)
    assert lines_of(proc) == []


def test_tail_does_not_import_torch(ports):
    code = (
        "import sys; from kvroute_cli.main import app\n"
        f"try: app(['events', 'tail', 'tcp://127.0.0.1:{ports[0]}', '--timeout', '0.2'])\n"
        "except SystemExit: pass\n"
        "assert 'events.subscriber' in sys.modules\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False"
