"""Gradient accumulation across micro-batches, on the grads tier: one mechanism for every stage.

Stages 0-2 (grads.py: whole flat buckets, or grad shards at stage 2) and stage 3 (stage3.py: grad
shards of units) accumulate the same way, so both use this class. Between boundaries each
micro-batch's tensor is added to its key's partial sum, kept in a store of the grads tier (any
tier: NVMe too, so partial sums need not stay in memory); on the boundary the full sum is handed
back and the key forgotten, so the next cycle starts from nothing without clearing any buffer.

It also keeps which parameters of each key are in the sum (`note`): a parameter
has a gradient in a cycle when it got one in any of its micro-batches, and with D ranks when any
rank's did (`agree`, at the boundary: DDP's all-reduce gives such a parameter a gradient on every
rank). The others are not stepped (ShardOptimizer.grad_ready's `missing`), as torch's
optimizers skip a parameter whose .grad is None.

The tensors handed in are owned by the caller and not referenced elsewhere (fresh flat buffers
or shards), so the previous sum is added into them in place: no new tensor per micro-batch. The
result is bit-identical to `t + previous` (IEEE addition is commutative, same dtype).
"""
from __future__ import annotations

import bisect
from typing import Sequence

import torch

from zero_offload import comm
from zero_offload.config import Config
from zero_offload.partition import FlatLayout
from zero_offload.store import make_store
from zero_offload.store.base import Store


class Accumulator:
    """Partial gradient sums by key in `store`; see the module docstring."""

    def __init__(self, store: Store, counts: dict[str, int] | None = None) -> None:
        """`counts`: each key's number of parameters, in the same order on every rank (what
        `agree` flags)."""
        self.store = store
        self._partial: set[str] = set()  # keys whose buffer holds this cycle's partial sum
        self._buffers: dict[str, tuple[int, torch.dtype]] = {}  # numel, dtype of each key's buffer in the store (allocated or adopted)
        # Keys whose buffer is an adopted micro-batch tensor: freed on the boundary, or the store
        # would hold a second copy of every gradient beside the sum handed on (a buffer the
        # store allocated, on the drive or pinned, is kept for the next cycle instead).
        self._adopted: set[str] = set()
        self._seen: set[str] = set()  # keys added to in this cycle
        self._flags = 0
        self._lacking: dict[str, set[int]] = {}  # key -> its parameters without a gradient in every micro-batch so far
        self._offsets: dict[str, int] = {}  # key -> its first flag in agree's vector
        for key, n in (counts or {}).items():
            self._offsets[key] = self._flags
            self._flags += n
        self._starts = list(self._offsets.values())

    @classmethod
    def on_grads_tier(cls, config: Config, device: torch.device, rank: int, counts: dict[str, int],
                      capacity_bytes: int) -> "Accumulator":
        """The accumulator a runtime keeps: its partial sums in a store of the grads tier (both
        runtimes make theirs alike; only the capacity they plan for differs)."""
        store = make_store(config.tiers.grads, "gradient-accumulation", config, device=device, rank=rank,
                           capacity_bytes=capacity_bytes)
        return cls(store, counts)

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

    def note(self, key: str, missing: Sequence[int]) -> None:
        """Key's parameters (indices) that got no gradient in this micro-batch; once per key and
        micro-batch. A parameter lacks a gradient in the cycle while it lacked one in every
        micro-batch."""
        if key not in self._seen:
            self._seen.add(key)
            if missing:
                self._lacking[key] = set(missing)
        elif key in self._lacking:
            kept = self._lacking[key].intersection(missing)
            if kept:
                self._lacking[key] = kept
            else:
                del self._lacking[key]

    def lacks(self, key: str) -> bool:
        """Whether some parameter of `key` got no gradient on this rank in this cycle so far."""
        return key in self._lacking

    def agree(self) -> dict[str, tuple[int, ...]]:
        """At the boundary, after every key was added: the parameters without a gradient in this
        cycle on every rank, by key. With D > 1 one small all-reduce (MAX of one 'had a
        gradient' byte per parameter), issued by every rank at every boundary so the collectives
        stay matched; none at D = 1. Starts the next cycle."""
        lacking, self._lacking, self._seen = self._lacking, {}, set()
        if comm.world_size() == 1:
            return {k: tuple(sorted(v)) for k, v in lacking.items()}
        flags = torch.ones(self._flags, dtype=torch.uint8)
        if lacking:
            flags[[self._offsets[k] + i for k, v in lacking.items() for i in v]] = 0
        arr = comm.all_reduce_(flags, "max").numpy()
        if arr.all():  # the usual case: every parameter had a gradient on some rank
            return {}
        keys, out = list(self._offsets), {}
        for at in (arr == 0).nonzero()[0].tolist():
            key = keys[bisect.bisect_right(self._starts, at) - 1]
            out.setdefault(key, []).append(at - self._offsets[key])
        return {k: tuple(v) for k, v in out.items()}

    def forget_cycle(self) -> None:
        """Forget which parameters the cycle's sums include (a backward that failed after some keys
        were added: the cycle is not gone on with)."""
        self._lacking, self._seen = {}, set()

    def held(self) -> dict[str, int]:
        """Bytes of each key's buffer in the store (the memory report names their padding)."""
        return {k: n * torch.empty((), dtype=d).element_size() for k, (n, d) in self._buffers.items()}

    def reset(self) -> None:
        """Forget every partial sum (a checkpoint load starts a fresh cycle); allocated buffers
        stay for reuse, adopted ones go."""
        self.forget_cycle()
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


def missing_ranges(layout: FlatLayout, rank: int, missing: Sequence[int]) -> list[tuple[int, int]]:
    """The element ranges of rank's shard of `layout` that hold the parameters `missing` (indices)."""
    wanted = set(missing)
    return [(pc.shard_offset, pc.shard_offset + pc.numel) for pc in layout.pieces(rank) if pc.index in wanted]
