"""What each chaos scenario observed, typed: the reliability tests assert on these fields,
``kvroute bench chaos`` prints each result's :class:`Row` and writes ``dataclasses.asdict``
of it into ``chaos.json``.

Every result the runner prints is a :class:`ChaosResult`: its ``row()`` says, in the
table's columns, what was injected and what it cost. Derived figures (``lost_count``) are
properties, so a result holds each observation once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

__all__ = [
    "ChaosResult",
    "ChunkedAnswer",
    "DroppedEventsResult",
    "EngineKillResult",
    "FuzzEventsResult",
    "FuzzHttpResult",
    "HttpFuzzRun",
    "LostList",
    "MsgpackFuzzRun",
    "OversizeAnswer",
    "OversizeResult",
    "RedisOutageResult",
    "Row",
    "StreamLoadResult",
]


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the chaos table (and of ``chaos.json``'s ``figures``)."""

    fault: str  # what was injected, in words
    injected: int | None  # faults injected (kills, dropped batches, payloads); None: n/a
    requests: int | None  # requests (or batches) that went through the fault; None: n/a
    lost: int | None  # what the fault cost: lost requests, stale entries, problems
    recovery_s: float | None  # fault over -> correct again, seconds; None: nothing to recover
    notes: str  # the figures behind the row, in words


class ChaosResult(Protocol):
    """A scenario's result as the runner prints it (a dataclass: ``chaos.json`` holds
    its ``asdict``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def row(self) -> Row: ...


class LostList:
    """A result whose ``lost`` lists what the fault cost, described (must be empty);
    ``lost_count`` is its length, derived so the list is held once."""

    __slots__ = ()
    lost: list[str]

    @property
    def lost_count(self) -> int:
        return len(self.lost)


@dataclass(frozen=True, slots=True)
class EngineKillResult(LostList):
    """``engine_kill``: engine A SIGKILLed while streams run, then restarted on its ports."""

    old_last_seq: int | None  # A's last applied seq before the kill (router's admin view)
    first_running_on_killed_s: float  # run start -> first stream seen running on A
    kill_at_s: float  # run start -> SIGKILL
    requests: int  # requests sent around the kill
    sent_after_kill: int  # of them, sent after the kill
    running_at_kill: int  # of them, in flight at the kill
    broken_streams: list[int]  # requests that ended with an SSE error chunk
    broken_streams_not_from_killed: list[int]  # of those, not served by A: must be empty
    lost: list[str]  # requests neither served nor cleanly failed, described: must be empty
    served_by: dict[str, int]  # engine URL -> requests it served completely
    detect_down_s: float  # kill -> the router marks A down
    resyncs_after_kill: float  # A's ingest resyncs after the kill (its residency dropped)
    restart_s: float  # A's restart -> its HTTP server ready
    old_residency_after_restart: int | None  # tokens of A's old prompt credited when it is back
    old_residency_after_rebuild: int | None  # the same, once its new events are ingested
    new_last_seq: int | None  # A's last applied seq after the rebuild (from 0 again)
    recovery_s: float  # restart -> the index holds A's new blocks
    up_after_restart_s: float  # restart -> the router marks A up
    rebuild_s: float  # A up -> its new events in the index

    def row(self) -> Row:
        notes = (
            f"{len(self.broken_streams)} started streams ended with an error chunk, "
            f"{self.sent_after_kill} requests sent after the kill; down detected in "
            f"{self.detect_down_s:.2f}s; recovery = restart -> index rebuilt (engine start "
            f"{self.restart_s:.1f}s)"
        )
        return Row(
            "engine SIGKILL mid-stream", 1, self.requests, self.lost_count, self.recovery_s, notes
        )


@dataclass(frozen=True, slots=True)
class DroppedEventsResult:
    """``dropped_events``: a window of event batches dropped between publisher and ingest."""

    buffer_steps: int  # the publisher's replay buffer, in batches
    replayable: bool  # the buffer outlives the run: replay can heal the gap
    dropped_removals: int  # BlockRemoved events in the dropped window
    recovery_s: float  # the batch after the gap published -> applied (gap handled)
    stale_after_gap: int  # index entries the engine no longer holds, right after the gap
    missing_after_gap: int  # engine entries the index lacks, right after the gap (history)
    injected: int  # batches the proxy dropped
    batches: int  # batches published in all
    truth_entries: int  # (group, hash, tier) entries the engine holds at the end
    index_entries: int  # entries the index holds for it at the end
    stale: int  # held by the index, not by the engine, at the end: must be 0
    missing: int  # held by the engine, not by the index, at the end (lost history)
    exact: bool  # index == engine at the end
    gaps: float  # gaps the subscriber detected
    missed_batches: float  # batches replay could no longer deliver
    replayed_batches: float  # batches recovered by replay
    resyncs: float  # clear-and-rebuild of the instance

    @property
    def lost_count(self) -> int:
        return self.stale + self.stale_after_gap

    def row(self) -> Row:
        fault = "event batches dropped" + (
            " (replayable)" if self.replayable else " (beyond replay buffer)"
        )
        notes = (
            f"requests = batches published; lost = stale index entries; right after the "
            f"gap {self.missing_after_gap} entries missing (history), at the end "
            f"{self.missing}/{self.truth_entries}; gaps {self.gaps:.0f}, resyncs "
            f"{self.resyncs:.0f}"
        )
        return Row(fault, self.injected, self.batches, self.lost_count, self.recovery_s, notes)


@dataclass(frozen=True, slots=True)
class RedisOutageResult(LostList):
    """``redis_outage``: Redis SIGKILLed under load, restarted empty."""

    requests: int  # requests sent during the whole run
    requests_during_outage: int  # of them, sent while Redis was down
    lost: list[str]  # requests that failed, described: must be empty
    fallback_seen: bool  # the router reported the index down (routing on load only)
    index_back_s: float  # Redis restarted -> lookups work again
    recovery_s: float  # Redis restarted -> the pre-outage probe is back in the index
    probe_holder: str  # engine URL that served the probe before the outage
    probe_view: dict[str, list[int]]  # engine URL -> index score for the probe, at the end
    index_errors: float  # the router's index errors (lookups that failed)
    resyncs: dict[str, float]  # engine URL -> ingest resyncs (history replayed from 0)

    def row(self) -> Row:
        notes = (
            f"fallback to load-only seen: {self.fallback_seen}; lookups back after "
            f"{self.index_back_s:.2f}s; recovery = restart -> history rebuilt"
        )
        return Row(
            "Redis killed, restarted empty",
            1,
            self.requests,
            self.lost_count,
            self.recovery_s,
            notes,
        )


@dataclass(frozen=True, slots=True)
class FuzzEventsResult:
    """``fuzz_events``: garbage msgpack frames into the real subscriber and ingest."""

    transport: str  # "inproc" or "tcp"
    injected: int  # payloads plus wrong-shaped frames sent
    decoded: int  # of them, decoded as batches
    undecodable: int  # of them, counted undecodable
    uncounted: int  # injected - decoded - undecodable: must be 0
    invalid_events: float  # well-formed events with impossible values, dropped and counted
    feed_errors: float  # errors that reached the feed's error counter: must be 0
    markers: int  # valid marker batches sent (one per chunk, one at the end)
    markers_stale: int  # markers handled but not applied (garbage ts ahead of theirs)
    wall_s: float  # the whole run

    @property
    def lost_count(self) -> int:
        return abs(self.uncounted) + int(self.feed_errors)

    def row(self) -> Row:
        fault = f"msgpack fuzz ({self.transport})"
        notes = f"{self.decoded} decoded, {self.undecodable} counted undecodable"
        return Row(fault, self.injected, None, self.lost_count, None, notes)


@dataclass(frozen=True, slots=True)
class MsgpackFuzzRun:
    """The bench's msgpack row: one fuzz run over inproc, one over TCP."""

    from_hypothesis: int  # payloads hypothesis generated (the rest: the seeded mutator)
    inproc: FuzzEventsResult  # the bulk of the payloads, in-process
    tcp: FuzzEventsResult  # a slice of them over loopback TCP

    def row(self) -> Row:
        a, b = self.inproc, self.tcp
        notes = (
            f"{self.from_hypothesis} from hypothesis; {a.decoded + b.decoded} decoded, "
            f"{a.undecodable + b.undecodable} counted undecodable, "
            f"{a.invalid_events + b.invalid_events:.0f} invalid events dropped; "
            f"lost = uncounted + feed errors"
        )
        return Row(
            "msgpack fuzz -> subscriber + ingest",
            a.injected + b.injected,
            None,
            a.lost_count + b.lost_count,
            None,
            notes,
        )


@dataclass(frozen=True, slots=True)
class FuzzHttpResult:
    """``fuzz_http``: random and mutated HTTP requests into one target."""

    injected: int  # cases sent
    problems: list[str]  # answers judged wrong (or no answer), described: must be empty
    statuses: dict[int, int]  # HTTP status -> answers with it
    healthy_after: bool  # the target answered /health with 200 afterwards
    wall_s: float  # sending every case

    @property
    def lost_count(self) -> int:
        return len(self.problems) + (not self.healthy_after)


@dataclass(frozen=True, slots=True)
class OversizeAnswer:
    """The answer to one oversize body."""

    status: int | None  # HTTP status of the answer (None: no parsable answer)
    body: Any  # the answer's JSON body, or its first 200 characters
    s: float  # seconds from the request's first byte to the answer


@dataclass(frozen=True, slots=True)
class ChunkedAnswer(OversizeAnswer):
    """The answer to an endless chunked body."""

    sent_bytes: int  # body bytes sent before the server answered
    offered_bytes: int  # body bytes the client would have sent in all


@dataclass(frozen=True, slots=True)
class OversizeResult:
    """``oversize_checks``: bodies over the limit must get a 413 before being read whole."""

    announced: OversizeAnswer  # Content-Length of 10 GB, 1 KiB sent
    chunked: ChunkedAnswer  # a chunked body that never ends

    @property
    def refused(self) -> int:
        """How many of the two were refused with 413."""
        return (self.announced.status == 413) + (self.chunked.status == 413)


@dataclass(frozen=True, slots=True)
class HttpFuzzRun:
    """The bench's HTTP row for one target: the fuzz run and the oversize checks."""

    target: str  # "router" or "engine"
    limit: int  # the target's body limit, in bytes
    fuzz: FuzzHttpResult  # the fuzzed requests
    oversize: OversizeResult  # the oversize bodies

    def row(self) -> Row:
        notes = (
            f"statuses {self.fuzz.statuses}; oversize bodies refused with 413: "
            f"{self.oversize.refused}/2 (chunked: after "
            f"{self.oversize.chunked.sent_bytes >> 20} MiB of a {self.limit >> 20} MiB limit)"
        )
        lost = self.fuzz.lost_count + 2 - self.oversize.refused
        return Row(
            f"HTTP fuzz -> {self.target}",
            self.fuzz.injected,
            self.fuzz.injected,
            lost,
            None,
            notes,
        )


@dataclass(frozen=True, slots=True)
class StreamLoadResult(LostList):
    """``stream_load``: concurrent streams through one router, each checked token for token."""

    streams: int  # concurrent streams per round
    rounds: int  # rounds of them
    requests: int  # streams sent in all rounds
    lost: list[str]  # streams lost or wrong, described: must be empty
    warm_lost: list[str]  # warm-up requests lost, described: must be empty
    distinct_ids: int  # distinct response ids seen (one per stream)
    wall_s: list[float]  # per round: all streams sent -> all done
    rss_baseline_mb: float  # router RSS after the warm-up
    rss_peak_mb: float  # router RSS peak during the rounds
    rss_after_mb: list[float]  # router RSS after each round settled
    running_after: dict[str, float]  # engine URL -> running requests the router counts, after
    inflight_after: dict[str, float]  # engine URL -> in-flight requests the router counts, after

    def row(self) -> Row:
        times = {1: "", 2: ", twice"}.get(self.rounds, f", {self.rounds} times")
        after = " / ".join(f"{v:.0f}" for v in self.rss_after_mb)
        notes = (
            f"{self.distinct_ids} distinct response ids; router RSS {self.rss_baseline_mb:.0f}"
            f" MB warm -> peak {self.rss_peak_mb:.0f} -> {after} MB after each round; wall "
            + " / ".join(f"{w:.1f}s" for w in self.wall_s)
        )
        return Row(
            f"{self.streams} concurrent streams{times}",
            0,
            self.requests,
            self.lost_count,
            None,
            notes,
        )
