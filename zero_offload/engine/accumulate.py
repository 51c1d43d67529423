"""Gradient accumulation across micro-batches, on the grads tier: one mechanism for every stage.

Stages 0-2 (grads.py: whole flat buckets, or grad shards at stage 2) and stage 3 (stage3.py: grad
shards of units) accumulate the same way, so both use this class. Between boundaries each
micro-batch's tensor is added to its key's partial sum, kept in a store of the grads tier (any
tier: NVMe too, so partial sums need not stay in memory); on the boundary the full sum is handed
back and the key forgotten, so the next cycle starts from nothing without clearing any buffer.

The tensors handed in are owned by the caller and not referenced elsewhere (fresh flat buffers
or shards), so the previous sum is added into them in place: no new tensor per micro-batch. The
result is bit-identical to `t + previous` (IEEE addition is commutative, same dtype).
"""
from __future__ import annotations

import torch

from zero_offload.store.base import Store


class Accumulator:
    """Partial gradient sums by key in `store`; see the module docstring."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._partial: set[str] = set()  # keys whose buffer holds this cycle's partial sum
        self._buffers: dict[str, tuple[int, torch.dtype]] = {}  # numel, dtype of each key's buffer in the store (allocated or adopted)
        # Keys whose buffer is an adopted micro-batch tensor: freed on the boundary, or the store
        # would hold a second copy of every gradient beside the sum handed on (a buffer the
        # store allocated, on the drive or pinned, is kept for the next cycle instead).
        self._adopted: set[str] = set()

    def add(self, key: str, t: torch.Tensor, boundary: bool) -> torch.Tensor | None:
        """Add `t` (handed over: modified in place) to key's partial sum. On the boundary return
        the sum and forget the key; otherwise store the sum and return None."""
        if key in self._partial:
            prev = self._load(key)  # from pinned memory the upload need not block the CPU
            t = t.add_(prev.to(t.device, non_blocking=prev.is_pinned()))
        if boundary:
            self._partial.discard(key)
            if key in self._adopted:  # the last micro-batch's own tensor: let it go with the sum
                self._adopted.discard(key)
                self._buffers.pop(key, None)
                self.store.free(key)
            return t
        if self.store.adopt(key, t):  # a resident tier keeps `t` itself: no copy
            self._adopted.add(key)
        else:
            if key not in self._buffers:
                self.store.allocate(key, t.numel(), t.dtype)
            self.store.write(key, t).wait()
        self._buffers[key] = (t.numel(), t.dtype)
        self._partial.add(key)
        return None

    def held(self) -> dict[str, int]:
        """Bytes of each key's buffer in the store (the memory report names their padding)."""
        return {k: n * torch.empty((), dtype=d).element_size() for k, (n, d) in self._buffers.items()}

    def reset(self) -> None:
        """Forget every partial sum (a checkpoint load starts a fresh cycle); allocated buffers
        stay for reuse, adopted ones go."""
        self._partial.clear()
        for key in self._adopted:
            self._buffers.pop(key, None)
            self.store.free(key)
        self._adopted.clear()

    def _load(self, key: str) -> torch.Tensor:
        """Key's partial sum: the store's tensor itself on a resident tier, else read back."""
        view = self.store.view(key)
        if view is not None:
            return view
        numel, dtype = self._buffers[key]
        return self.store.read(key, self.store.staging_buffer(numel, dtype)).wait()  # the store's fast path

    def close(self) -> None:
        """Release the store (NVMe files are removed)."""
        self.store.close()
