"""Sub-shards: a shard too large for a third of the staging ring is stepped as several sub-shards.

Adam is elementwise, so a shard's update can be computed sub-shard by sub-shard. On a tier that is not
addressable (nvme) each sub-shard has its own store key and ring region, so a stage-3 unit or a
bucket of any size streams through a ring of pinned_budget_bytes with reads, steps and writes
still overlapping (one sub-shard stepping, one being written, one being read: three per ring). A
resident tier steps each shard whole (one sub-shard, under the shard's own key).

A split shard's updated compute copy is assembled from its sub-shards into one buffer (Assembly);
the receiver (on_updated) sees whole shards only. Checkpoints and read_state/write_state see whole
shards too: sub-shards are a layout of the optimizer tier, not of the saved state.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from zero_offload.engine.step.staging_ring import ALIGN_ELEMENTS
from zero_offload.engine.step.pipeline import updated_buffer
from zero_offload.optim.adamw import ADAMW
from zero_offload.optim.spec import OptimizerSpec


@dataclass(frozen=True)
class SubShard:
    key: str  # the store key (and ring region) of this sub-shard
    owner: str  # the shard it belongs to
    lo: int
    hi: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


SUBSHARDS_PER_RING = 3  # one stepping, one being written back, one being read


def subshard_limit(budget_bytes: int, spec: OptimizerSpec = ADAMW) -> int:
    """Most elements per sub-shard: three sub-shards' state (the spec's bytes per element: 12 for
    AdamW's master + m + v) fill the budget."""
    per_subshard = budget_bytes // (SUBSHARDS_PER_RING * spec.bytes_per_element)
    return max(ALIGN_ELEMENTS, per_subshard // ALIGN_ELEMENTS * ALIGN_ELEMENTS)


def split(key: str, numel: int, limit: int | None) -> list[SubShard]:
    """`key` whole when it fits `limit` (or no limit), else near-equal page-aligned sub-shards."""
    if limit is None or numel <= limit:
        return [SubShard(key, key, 0, numel)]
    count = -(-numel // limit)
    size = -(-numel // count // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    return [SubShard(f"{key}#{i}", key, lo, min(lo + size, numel)) for i, lo in enumerate(range(0, numel, size))]


class Assembly:
    """Updated compute-copy buffers of split shards, filled by their sub-shards on the step worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, tuple[torch.Tensor, int]] = {}  # owner -> (buffer, sub-shards to come)

    def begin(self, owner: str, numel: int, subs: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh buffer for `owner`'s updated shard (page-aligned and pinned where CUDA is, as
        step.updated_buffer says why)."""
        buf = updated_buffer(numel, dtype, torch.device("cpu"))
        with self._lock:
            if owner in self._open:
                raise RuntimeError(f"shard {owner!r} is already being updated in this step")
            self._open[owner] = (buf, subs)
        return buf

    def subshard_done(self, owner: str) -> torch.Tensor | None:
        """Count one sub-shard of `owner` as written; the whole buffer once the last one is."""
        with self._lock:
            buf, left = self._open[owner]
            if left > 1:
                self._open[owner] = (buf, left - 1)
                return None
            del self._open[owner]
            return buf

    def abandon(self) -> None:
        """Forget every partly updated shard (after a failed or skipped step)."""
        with self._lock:
            self._open.clear()
