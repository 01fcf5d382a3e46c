"""What ingest tells the rest of the router: one typed listener, given at construction."""

from __future__ import annotations

from typing import Protocol

from events.structs import KVEventBatch

__all__ = ["IngestListener"]


class IngestListener(Protocol):
    """Told, on ingest's loop, about each instance's batches (predict-on-route's owner,
    ``router.prediction.predict.PredictOnRoute``). Both calls must be cheap and must not
    raise: they run between a batch's decode and the next one's."""

    def batch_learned(self, instance: str, batch: KVEventBatch) -> None:
        """``batch`` is about to be applied (memory pressure is read here)."""

    def batch_applied(self, instance: str) -> None:
        """``instance``'s batches so far were applied to the index."""
