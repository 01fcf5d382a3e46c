"""``kvroute bench chaos``'s report: one ``figures`` row per result (its ``row()``) and,
beside it, the typed result it came from, as JSON; a fault's cost is counted in the row."""

from __future__ import annotations

import json
from pathlib import Path

from stack.chaos import run
from stack.chaos.results import (
    ChunkedAnswer,
    FuzzHttpResult,
    HttpFuzzRun,
    OversizeAnswer,
    OversizeResult,
)

ROW_KEYS = ["fault", "injected", "requests", "lost", "recovery_s", "notes"]


def test_a_small_fuzz_run_writes_one_figures_row_and_its_typed_details(tmp_path: Path, capsys):
    report = run(tmp_path, only={"fuzz"}, fuzz_payloads=300, hypothesis_examples=50, seed=3)
    written = json.loads((tmp_path / "chaos.json").read_text())
    assert written["figures"] == report["figures"]
    (row,) = written["figures"]
    assert list(row) == ROW_KEYS
    assert row["fault"] == "msgpack fuzz -> subscriber + ingest"
    assert row["injected"] == 300 + 2 * 4 and row["lost"] == 0
    assert row["requests"] is None and row["recovery_s"] is None
    assert row["notes"].startswith("50 from hypothesis; ")
    (details,) = written["details"]
    assert details["fault"] == row["fault"] and details["from_hypothesis"] == 50
    transports = (details["inproc"], details["tcp"])
    assert [d["transport"] for d in transports] == ["inproc", "tcp"]
    assert sum(d["injected"] for d in transports) == row["injected"]
    assert all(d["uncounted"] == 0 and d["feed_errors"] == 0 for d in transports)
    assert "msgpack fuzz -> subscriber + ingest" in capsys.readouterr().out


def test_an_oversize_body_that_is_not_refused_counts_as_lost_in_the_http_row():
    fuzz = FuzzHttpResult(5, problems=[], statuses={400: 5}, healthy_after=True, wall_s=0.1)
    refused = OversizeAnswer(413, {"error": {"code": 413}}, 0.01)
    read_whole = ChunkedAnswer(200, {}, 2.0, sent_bytes=80 << 20, offered_bytes=80 << 20)
    row = HttpFuzzRun("router", 1 << 20, fuzz, OversizeResult(refused, read_whole)).row()
    assert (row.fault, row.injected, row.requests, row.lost) == ("HTTP fuzz -> router", 5, 5, 1)
    assert "refused with 413: 1/2 (chunked: after 80 MiB of a 1 MiB limit)" in row.notes
