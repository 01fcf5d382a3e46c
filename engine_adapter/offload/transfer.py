"""GPU <-> CPU copies of KV pages, per group, off the engine thread.

A job moves pages between the device KV tensors (``(num_blocks, page)`` per group) and the
host chunk tensors (``(num_chunks * k, page)`` per group) given, per group, matching lists
of device rows and host rows (vLLM's multi-group transfer with per-group block indices).
``poll``/``wait`` only *observe* completion; callers publish events for a job after that.

* CUDA: everything is queued on a dedicated stream after the compute stream's pending
  work, to or from pinned host memory, and a CUDA event marks completion. Scattered
  device pages are gathered into (or scattered from) a contiguous device staging buffer
  with one kernel, so the PCIe copies are one per contiguous host run, whatever the page
  size.
* CPU (no CUDA): a few worker threads copy contiguous runs through NumPy views of the same
  tensors. ``np.copyto`` is a plain memcpy that releases the GIL; torch's own ``copy_``
  would fan each page out to the intra-op thread pool, which the engine thread also uses.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["GroupCopy", "TransferEngine", "coalesce"]

logger = logging.getLogger(__name__)

Direction = Literal["store", "load"]
_Run = tuple[np.ndarray, np.ndarray, int, int, int]  # src, dst, src row, dst row, rows


@dataclass(frozen=True, slots=True)
class GroupCopy:
    """Pages of one group: device row ``gpu_rows[i]`` <-> host row ``cpu_rows[i]``."""

    group_idx: int
    gpu_rows: Sequence[int]
    cpu_rows: Sequence[int]


def _run_starts(*rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start offsets and lengths of the runs where every row array advances by one."""
    n = len(rows[0])
    step = np.zeros(max(n - 1, 0), dtype=bool)
    for r in rows:
        step |= np.diff(r) != 1
    breaks = np.flatnonzero(step) + 1
    starts = np.concatenate(([0], breaks))
    return starts, np.diff(np.concatenate((starts, [n])))


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both row lists advance by one."""
    runs: list[tuple[int, int, int]] = []
    if not src:
        return runs
    s0, d0, n = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


def _run_starts(*rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``coalesce`` in NumPy: start offsets and lengths of the runs where every row array
    advances by one. The CUDA path needs only the count to choose how to copy, and no
    per-run tuple when the pages are scattered."""
    n = len(rows[0])
    step = np.zeros(max(n - 1, 0), dtype=bool)
    for r in rows:
        step |= np.diff(r) != 1
    starts = np.concatenate(([0], np.flatnonzero(step) + 1))
    return starts, np.diff(np.concatenate((starts, [n])))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows of bytes) viewed as rows of 8-byte words when its rows allow it, else
    itself: the same memory, row for row."""
    if t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] % 8 == 0 and t.is_contiguous():
        return t.view(torch.int64)
    return t


def _split(runs: list[_Run], parts: int) -> list[list[_Run]]:
    """Cut runs into ``parts`` lists of about equal rows (splitting runs as needed)."""
    total = sum(r[4] for r in runs)
    target = max(1, -(-total // parts))
    out: list[list[_Run]] = [[]]
    room = target
    for src, dst, s, d, n in runs:
        while n:
            take = min(n, room)
            out[-1].append((src, dst, s, d, take))
            s, d, n, room = s + take, d + take, n - take, room - take
            if room == 0 and n:
                out.append([])
                room = target
        if room == 0:
            out.append([])
            room = target
    return [p for p in out if p]


def _copy_runs(runs: list[_Run]) -> None:
    for src, dst, s, d, n in runs:
        np.copyto(dst[d : d + n], src[s : s + n])


class TransferEngine:
    """Submits copy jobs and reports which finished; one job may span many groups."""

    def __init__(
        self,
        gpu_kv: Sequence[torch.Tensor],
        cpu_kv: Sequence[torch.Tensor],
        *,
        num_workers: int | None = None,
    ) -> None:
        if len(gpu_kv) != len(cpu_kv):
            raise ValueError("one device and one host tensor per group")
        self.gpu_kv = list(gpu_kv)
        self.cpu_kv = list(cpu_kv)
        self.device = self.gpu_kv[0].device if self.gpu_kv else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        # The gather/scatter kernels move 8-byte words when a page allows it: byte-wide
        # index_copy_ on uint8 pages ran well under the PCIe copy's speed.
        self._gpu_wide = [_wide(t) for t in self.gpu_kv]
        self._cpu_wide = [_wide(t) for t in self.cpu_kv]
        self._executor: ThreadPoolExecutor | None = None
        if not self._cuda:
            self._workers = max(1, min(num_workers or os.cpu_count() or 1, 8))
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="kv-offload")
            self._gpu_np = [t.numpy() for t in self.gpu_kv]
            self._cpu_np = [t.numpy() for t in self.cpu_kv]
        # job id -> completion handle (CUDA event, or the worker futures), in order.
        self._pending: dict[int, torch.cuda.Event | list[Future[None]]] = {}
        self.bytes_copied = 0

    # ---- submission -------------------------------------------------------------------

    def submit(self, job_id: int, direction: Direction, copies: Sequence[GroupCopy]) -> None:
        """Start copying; returns at once. ``direction``: store = GPU->CPU, load = CPU->GPU."""
        if job_id in self._pending:
            raise ValueError(f"job {job_id} already submitted")
        self.bytes_copied += sum(
            len(gc.gpu_rows) * self.gpu_kv[gc.group_idx].shape[1] for gc in copies
        )
        if self._cuda:
            self._pending[job_id] = self._submit_cuda(direction, copies)
        else:
            self._pending[job_id] = self._submit_threads(direction, copies)

    def _submit_threads(
        self, direction: Direction, copies: Sequence[GroupCopy]
    ) -> list[Future[None]]:
        assert self._executor is not None
        runs: list[_Run] = []
        for gc in copies:
            dev, host = self._gpu_np[gc.group_idx], self._cpu_np[gc.group_idx]
            if direction == "store":
                runs += [(dev, host, s, d, n) for s, d, n in coalesce(gc.gpu_rows, gc.cpu_rows)]
            else:
                runs += [(host, dev, s, d, n) for s, d, n in coalesce(gc.cpu_rows, gc.gpu_rows)]
        return [self._executor.submit(_copy_runs, part) for part in _split(runs, self._workers)]

    def _submit_cuda(self, direction: Direction, copies: Sequence[GroupCopy]) -> torch.cuda.Event:
        assert self._stream is not None
        stream = self._stream
        # Source pages may still be written by work queued on the compute stream.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for gc in copies:
                self._copy_group_cuda(direction, gc)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _copy_group_cuda(self, direction: Direction, gc: GroupCopy) -> None:
        dev, host = self._gpu_wide[gc.group_idx], self._cpu_wide[gc.group_idx]
        rows = np.asarray(gc.gpu_rows, dtype=np.int64)
        cpu_rows = np.asarray(gc.cpu_rows, dtype=np.int64)
        if not len(rows):
            return
        starts, lengths = _run_starts(rows, cpu_rows)
        if len(starts) * 4 <= len(rows) or len(starts) == 1:
            # Already mostly contiguous: copy the runs directly.
            pairs = zip(
                rows[starts].tolist(), cpu_rows[starts].tolist(), lengths.tolist(), strict=True
            )
            for s, d, n in pairs:
                if direction == "store":
                    host[d : d + n].copy_(dev[s : s + n], non_blocking=True)
                else:
                    dev[s : s + n].copy_(host[d : d + n], non_blocking=True)
            return
        # Scattered device pages: one gather/scatter kernel + one PCIe copy per host run.
        idx = torch.from_numpy(rows).pin_memory().to(self.device, non_blocking=True)
        starts, lengths = _run_starts(cpu_rows)
        host_runs = zip(starts.tolist(), cpu_rows[starts].tolist(), lengths.tolist(), strict=True)
        if direction == "store":
            staging = torch.index_select(dev, 0, idx)
            for i, d, n in host_runs:
                host[d : d + n].copy_(staging[i : i + n], non_blocking=True)
        else:
            staging = torch.empty((len(cpu_rows), dev.shape[1]), dtype=dev.dtype, device=dev.device)
            for i, d, n in host_runs:
                staging[i : i + n].copy_(host[d : d + n], non_blocking=True)
            dev.index_copy_(0, idx, staging)
        # ``staging`` and ``idx`` were allocated on this stream: freeing them now is safe,
        # the caching allocator reuses their memory only after this stream's queued work.

    # ---- completion -------------------------------------------------------------------

    def is_done(self, job_id: int) -> bool:
        handle = self._pending[job_id]
        if isinstance(handle, list):
            return all(f.done() for f in handle)
        return handle.query()

    def poll(self) -> list[int]:
        """Jobs that finished since the last call, in submission order (errors re-raised)."""
        done = [job for job in self._pending if self.is_done(job)]
        for job in done:
            self._finish(job)
        return done

    def wait(self, job_ids: Iterable[int]) -> list[int]:
        """Block until the given jobs finished; returns those it finished (poll won't)."""
        finished = []
        for job in job_ids:
            if job in self._pending:
                self._finish(job)
                finished.append(job)
        return finished

    def wait_all(self) -> list[int]:
        return self.wait(list(self._pending))

    def _finish(self, job_id: int) -> None:
        handle = self._pending.pop(job_id)
        if isinstance(handle, list):
            for f in handle:
                f.result()  # blocks; surfaces a failed copy instead of publishing events
        else:
            handle.synchronize()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self.wait_all()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
