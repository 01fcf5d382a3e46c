"""vLLM's ``OffloadingConnector`` on the CPU build: an out-of-tree spec with a host worker.

Imported only by vLLM's venv (the API server and the engine-core process), never by the
project: the launcher names this module in ``kv_connector_extra_config`` as
``spec_module_path`` and ``spec_name = "KvrouteHostOffloadingSpec"``, and puts this
directory on ``PYTHONPATH`` (``engine_adapter.vllm_cpu.server_env(cpu_offload=...)``).

Why it exists: ``CPUOffloadingSpec.get_worker()`` refuses to run unless the platform is
CUDA-alike or XPU, and its copy engine (``cpu/gpu_worker.py``) needs CUDA streams. Everything
else of the connector is plain Python: the scheduler side, ``CPUOffloadingManager`` with
its LRU / ARC policies, the sizing (``num_chunks``), the ``medium="CPU"`` KV events and the
metrics. This spec subclasses ``CPUOffloadingSpec`` and overrides only ``get_worker()``,
so all of that stays vLLM's own code.

The worker does per transfer what vLLM's ``SingleDirectionOffloadingHandler.transfer_async``
does with its direct (worker-private) layout: walk the groups of the GPU spec
(``group_sizes``, ``block_indices``), skip ``block_idx % blocks_per_chunk`` sub-blocks of
the first chunk on the chunk side, find each page's address with vLLM's own
``compute_sub_block_ptrs`` and copy ``page_size_bytes`` per page and data ref -- here a
``ctypes.memmove`` between host tensors, done at submission. Completed jobs are reported
from ``get_finished()`` in submission order per direction, as the CUDA handler's event
queue does. ``kvroute_hold_polls`` (extra config, default 0) holds each result back for
that many ``get_finished()`` calls, so a copy looks in flight for a few engine steps
(``kvroute_hold_load_polls``, default the same, holds the loads alone: a request's
siblings then find its load in flight and vLLM defers them);
``wait()`` releases the held jobs it names (vLLM's flush path).
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

__all__ = ["HostOffloadingWorker", "KvrouteHostOffloadingSpec"]

# Under "vllm." so vLLM's own logging configuration prints it into the server log.
logger = logging.getLogger("vllm.kvroute.offload_spec")

HOLD_POLLS_KEY = "kvroute_hold_polls"
HOLD_LOAD_POLLS_KEY = "kvroute_hold_load_polls"


@dataclass
class _Done:
    job_id: int
    num_bytes: int
    polls_left: int


class _HostDirection:
    """One direction (GPU->CPU stores or CPU->GPU loads) over host tensors.

    ``gpu_tensors[t]``: ``(num_blocks, page)`` int8 views of the engine's KV cache;
    ``cpu_tensors[t]``: ``(num_chunks, page * blocks_per_chunk)`` int8 host chunks.
    """

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        hold_polls: int,
    ) -> None:
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.gpu_to_cpu = gpu_to_cpu
        self.layer_refs_per_group = layer_refs_per_group
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self.hold_polls = hold_polls
        self._done: deque[_Done] = deque()

    def transfer(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        assert len(gpu_spec.group_sizes) == len(self.layer_refs_per_group)
        src_offset = dst_offset = 0
        num_bytes = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        ):
            if group_size == 0:
                continue
            src_skip = block_idx % self.src_blocks_per_chunk
            dst_skip = block_idx % self.dst_blocks_per_chunk
            src_count = cdiv(group_size + src_skip, self.src_blocks_per_chunk)
            dst_count = cdiv(group_size + dst_skip, self.dst_blocks_per_chunk)
            group_src = src_blocks[src_offset : src_offset + src_count]
            group_dst = dst_blocks[dst_offset : dst_offset + dst_count]
            assert len(group_src) == src_count and len(group_dst) == dst_count
            for ref in self.layer_refs_per_group[g_idx]:
                src_ptrs = np.empty(group_size, dtype=np.uint64)
                dst_ptrs = np.empty(group_size, dtype=np.uint64)
                compute_sub_block_ptrs(
                    group_src,
                    self.src_blocks_per_chunk,
                    src_ptrs,
                    self.src_tensors[ref.tensor_idx],
                    skip_count=src_skip,
                )
                compute_sub_block_ptrs(
                    group_dst,
                    self.dst_blocks_per_chunk,
                    dst_ptrs,
                    self.dst_tensors[ref.tensor_idx],
                    skip_count=dst_skip,
                )
                size = ref.page_size_bytes
                for s, d in zip(src_ptrs.tolist(), dst_ptrs.tolist(), strict=True):
                    ctypes.memmove(d, s, size)
                num_bytes += group_size * size
            src_offset += src_count
            dst_offset += dst_count
        assert src_offset == len(src_blocks) and dst_offset == len(dst_blocks)
        self._done.append(_Done(job_id, num_bytes, self.hold_polls))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Jobs whose hold expired, in submission order (a held job holds later ones)."""
        out: list[TransferResult] = []
        while self._done and self._done[0].polls_left <= 0:
            done = self._done.popleft()
            out.append(TransferResult(done.job_id, True, done.num_bytes, 0.0))
        for done in self._done:
            done.polls_left -= 1
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Flush: the named jobs (and those before them, FIFO) count as done now."""
        last = max((i for i, d in enumerate(self._done) if d.job_id in job_ids), default=-1)
        for done in list(self._done)[: last + 1]:
            done.polls_left = 0


class HostOffloadingWorker(OffloadingWorker):
    """vLLM's ``CPUOffloadingWorker`` with host memory on both sides and no streams."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        hold_polls: int = 0,
        hold_load_polls: int | None = None,
    ) -> None:
        gpu_tensors: list[torch.Tensor] = []
        cpu_tensors: list[torch.Tensor] = []
        for kv in kv_caches.tensors:
            tensor = kv.tensor
            assert tensor.dtype == torch.int8 and tensor.ndim == 2
            assert tensor.shape[1] == kv.page_size_bytes
            gpu_tensors.append(tensor)
            cpu_tensors.append(
                torch.zeros(
                    (num_cpu_chunks, kv.page_size_bytes * blocks_per_chunk), dtype=torch.int8
                )
            )
        logger.info(
            "host offloading worker: %d tensors, %d chunks of %d blocks, hold %d polls",
            len(cpu_tensors),
            num_cpu_chunks,
            blocks_per_chunk,
            hold_polls,
        )
        refs = kv_caches.group_data_refs
        self._store = _HostDirection(
            gpu_tensors, cpu_tensors, blocks_per_chunk, refs, True, hold_polls
        )
        self._load = _HostDirection(
            gpu_tensors,
            cpu_tensors,
            blocks_per_chunk,
            refs,
            False,
            hold_polls if hold_load_polls is None else hold_load_polls,
        )

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._store.transfer(job_id, src_spec, dst_spec)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._load.transfer(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return self._store.get_finished() + self._load.get_finished()

    def wait(self, job_ids: set[int]) -> None:
        self._store.wait(job_ids)
        self._load.wait(job_ids)


class KvrouteHostOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` whose worker copies in host memory (any platform).

    Logs vLLM's sizing once per process (``kvroute offload tier: num_chunks=...``): tests
    read it to give the simulated engine the same number of CPU chunks.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        logger.info(
            "kvroute offload tier: num_chunks=%d kv_bytes_per_chunk=%d blocks_per_chunk=%d "
            "worker_kv_bytes_per_block=%d",
            self.num_chunks,
            self.kv_bytes_per_chunk,
            self.blocks_per_chunk,
            config.worker_kv_bytes_per_block,
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostOffloadingWorker(  # type: ignore[assignment]
                kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                hold_polls=int(self.extra_config.get(HOLD_POLLS_KEY, 0)),
                hold_load_polls=(
                    None
                    if self.extra_config.get(HOLD_LOAD_POLLS_KEY) is None
                    else int(self.extra_config[HOLD_LOAD_POLLS_KEY])
                ),
            )
        return self._worker  # type: ignore[return-value]
