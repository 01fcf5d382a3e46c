"""An engine SIGKILLed mid-run: nothing lost that had not started, started streams end with
an error chunk, the dead engine's residency goes, and comes back from its new events only."""

from __future__ import annotations

from stack.chaos import Fleet, engine_kill


async def test_engine_sigkill_mid_run_loses_nothing_unstarted_and_rebuilds_from_new_events(
    fleet: Fleet,
):
    r = await engine_kill(fleet, requests=40, spread_s=3.0)
    b = fleet.procs[1].url  # the engine left alive
    # The kill hit a live run: streams were running on A, more requests came after it.
    assert r.running_at_kill > 0 and r.sent_after_kill > 0, r
    assert r.broken_streams, f"no stream was running on the killed engine: {r}"
    # 0 lost: every request is complete and correct, or a stream that had started on the
    # killed engine and ended with an SSE error chunk.
    assert r.lost == [], "\n".join(r.lost)
    assert r.broken_streams_not_from_killed == []
    assert r.served_by[b] > 0
    assert r.detect_down_s < 5.0
    # Down -> its residency is dropped (resync), so when it is back, healthy, before it
    # has published anything, the router credits it with nothing from its old life ...
    assert r.resyncs_after_kill >= 1
    assert r.old_residency_after_restart == 0
    # ... and what it knows afterwards comes from the new incarnation's events only.
    assert r.old_residency_after_rebuild == 0
    assert r.new_last_seq is not None and r.old_last_seq is not None
    assert r.new_last_seq < r.old_last_seq
