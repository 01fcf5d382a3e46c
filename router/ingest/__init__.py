"""Event ingest: one subscriber per engine instance, applied in order into a block index.

Per subscriber item (``events.subscriber``; gaps are already healed by replay there):

* ``BatchReceived`` -> learn the group layout, apply ``(batch, seq)`` to the index. The
  subscriber is read ahead in a task: batches that queued up while the previous ones were
  being applied (a backlog, a replay) go to ``index.apply_many`` together, up to
  ``drain_batches`` / ``drain_blocks`` -- one round trip to a shared index instead of one
  per batch -- still in order and counted one by one. The index skips batches older than
  its cursor, so re-deliveries and a second ingester of the same source never double
  count.
* ``SourceRestarted`` -> the engine restarted and its cache is empty: the *next* batch is
  applied with ``reset=True``, which drops the instance's state in the same atomic step
  (two ingesters sharing Redis then reset once, not twice).
* ``BatchesMissed`` -> state is unknown: clear the instance; with a replay endpoint,
  re-subscribe from seq 0, i.e. rebuild from everything the publisher still buffers
  (``buffer_steps`` batches). Older history is lost either way; a rebuilt state may lack
  blocks (under-predicts) but never holds blocks the engine evicted in the lost range.
  Missed ranges reported while resyncing are that older history and are only counted.
* ``remove_instance`` -> stop the subscriber and clear the instance.
* ``resync`` (the router calls it when an instance goes down: it may come back restarted,
  with an empty cache) -> clear the instance now, rebuild it from replay (seq 0 on).
* The index lost the instance (a Redis restarted empty, a heartbeat reaped): once batches
  were applied, the index must hold the instance's cursor. ``apply_many`` reports a batch
  that found none (``ApplyResult.cursor_absent``, no extra round trip), and the cursor is
  checked every ``cursor_check_s`` while idle; either forces a resync -- otherwise new
  batches would pile onto an empty state and the history never come back.

Bad payloads are counted by the subscriber and skipped; events naming an impossible
``group_idx`` and batches with an impossible ``ts`` (NaN, an hour ahead) are dropped and
counted (status ``invalid``); an index error is retried with backoff, then forces a resync.
Nothing here lets one instance's trouble stop the others.

Memory follows the index, not the backlog: events are decoded without token ids (the
router never re-hashes them), the read-ahead is bounded in block hashes, at most
``concurrent_replays`` replays are in flight, and the heap is trimmed after a large
backlog (``trim``).

Modules: ``manager`` (``IngestManager``), ``sources`` (where events come from, per-instance
feed state), ``ahead`` (reading a source ahead), ``metrics`` (``kvroute_ingest_*``),
``checks`` (impossible events and ts) and ``trim`` (giving the heap back).
"""

from router.ingest.manager import IngestManager
from router.ingest.metrics import IngestMetrics
from router.ingest.sources import EventSource, InstanceSource
from router.ingest.sources import SourceFactory as SourceFactory

__all__ = ["EventSource", "IngestManager", "IngestMetrics", "InstanceSource"]
