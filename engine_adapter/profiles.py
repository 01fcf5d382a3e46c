"""Model profiles (which KV cache groups a model has) and their canonical KV tensors.

A profile is an ordered tuple of group specs (``group_idx`` = position) plus a page size
per group: the bytes one block of that group occupies across all of the group's layers.
Following vLLM's canonical KV cache layout (PR 37853), every group owns one
``(num_blocks, page_bytes)`` uint8 tensor, so a block is one contiguous page whatever the
attention kind, and offloading copies pages without knowing about layers or heads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine_adapter.sim.settings import PROFILE_NAMES, EngineSettings
from events.groups import (
    KVCacheLayout,
    KVCacheSpec,
    parse_layout,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_PAGE_BYTES",
    "DEFAULT_SLIDING_WINDOW",
    "PROFILE_NAMES",
    "ModelProfile",
    "allocate_cpu_kv",
    "allocate_gpu_kv",
    "default_device",
    "get_profile",
    "parse_layout",
]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
# The profile names and these defaults are the engine's settings' (written there once).
DEFAULT_SLIDING_WINDOW: int = EngineSettings.model_fields["sliding_window"].default
DEFAULT_PAGE_BYTES: int = EngineSettings.model_fields["page_bytes"].default


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """A model's KV cache groups and the page size (bytes per block) of each."""

    name: str
    layout: KVCacheLayout
    page_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.page_bytes) != len(self.layout.groups):
            raise ValueError("one page size per KV cache group is required")
        if any(p <= 0 for p in self.page_bytes):
            raise ValueError("page sizes must be positive")
        sizes = {g.block_size for g in self.layout.groups}
        # The engine hashes at one block size; vLLM's larger-block groups (concatenated
        # hashes) are not modelled here.
        if len(sizes) != 1:
            raise ValueError(f"all groups must share one block size, got {sorted(sizes)}")

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        return self.layout.groups

    @property
    def num_groups(self) -> int:
        return len(self.layout.groups)

    @property
    def block_size(self) -> int:
        return self.layout.groups[0].block_size


# Real model families: (layout spec, vLLM's block size on GPU for them). Group order is
# vLLM's group_idx order (layer 0's kind first); group counts follow vLLM's grouping
# (layers per group = the smaller count per kind).
FAMILIES: dict[str, tuple[str, int]] = {
    "gemma3": ("swa:1024*5,full", 16),  # 5 local layers (window 1024) : 1 global
    "gpt-oss": ("swa:128,full", 16),  # alternating window-128 and full layers
    "qwen3-next": ("mamba*3,full", 256),  # 3 Gated DeltaNet : 1 full; state-sized blocks
    "llama": ("full", 16),
}


def get_profile(
    name: str,
    *,
    block_size: int | None = None,
    sliding_window: int = DEFAULT_SLIDING_WINDOW,
    page_bytes: int | Sequence[int] = DEFAULT_PAGE_BYTES,
    layout: str | None = None,
) -> ModelProfile:
    """A profile: ``layout`` (a spec for :func:`parse_layout`) wins; else a model family
    (``gemma3``, ``gpt-oss``, ``qwen3-next``, ``llama``) or one of the 1:1 profiles
    ``full``, ``swa-hybrid`` (window ``sliding_window``), ``mamba-hybrid``.
    ``page_bytes``: one size or one per group."""
    if layout is not None:
        spec, bs = layout, block_size or DEFAULT_BLOCK_SIZE
    elif name in FAMILIES:
        spec, default_bs = FAMILIES[name]
        bs = block_size or default_bs
    elif name == "full":
        spec, bs = "full", block_size or DEFAULT_BLOCK_SIZE
    elif name == "swa-hybrid":
        spec, bs = f"full,swa:{sliding_window}", block_size or DEFAULT_BLOCK_SIZE
    elif name == "mamba-hybrid":
        spec, bs = "full,mamba", block_size or DEFAULT_BLOCK_SIZE
    else:
        raise ValueError(f"unknown profile {name!r}; expected one of {PROFILE_NAMES}")
    groups = parse_layout(spec, bs)
    n = len(groups.groups)
    pages = (page_bytes,) * n if isinstance(page_bytes, int) else tuple(int(p) for p in page_bytes)
    return ModelProfile(layout if layout is not None else name, groups, pages)


def default_device() -> torch.device:
    """The engine's KV device: CUDA when present, else CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def allocate_gpu_kv(
    profile: ModelProfile, num_blocks: int, device: torch.device | None = None
) -> list[torch.Tensor]:
    """One zeroed ``(num_blocks, page_bytes)`` uint8 tensor per group on ``device``."""
    device = device or default_device()
    return [
        torch.zeros((num_blocks, page), dtype=torch.uint8, device=device)
        for page in profile.page_bytes
    ]


def allocate_cpu_kv(
    profile: ModelProfile, num_chunks: int, blocks_per_chunk: int, pin: bool | None = None
) -> list[torch.Tensor]:
    """Per group ``(num_chunks * blocks_per_chunk, page_bytes)`` host tensors.

    Row ``slot * blocks_per_chunk + i`` holds block ``i`` of the chunk in ``slot``. Pinned
    (page-locked, for async DMA) only when CUDA is present: pinning needs a CUDA context.
    """
    if pin is None:
        pin = torch.cuda.is_available()
    rows = num_chunks * blocks_per_chunk
    tensors = [
        torch.zeros((rows, page), dtype=torch.uint8, pin_memory=pin) for page in profile.page_bytes
    ]
    logger.debug("allocated %d CPU chunk slots per group (pinned=%s)", num_chunks, pin)
    return tensors
