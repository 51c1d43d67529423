"""Flat buffers and shards: where each parameter's elements sit, and which rank owns them.

A flat buffer lays a group of parameters out contiguously, in a fixed order, padded at the end so
it splits into D equal shards. Rank r owns elements [r*S, (r+1)*S) with S = padded_numel / D; all
optimizer state is kept per shard. A parameter may straddle two shards; `pieces(rank)` lists the
parts of each parameter that fall in one rank's shard, which is all the engine needs to copy
between per-parameter tensors and shards.

Padding is extra alignment too: each shard's numel is rounded up to `align` elements so that
shards and NVMe slots start on whole vector widths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from zero_offload.io.buffers import aligned_tensor


@dataclass(frozen=True)
class Piece:
    """The part of parameter `index` that lies in one shard: param[param_offset : +numel] ==
    shard[shard_offset : +numel] (both flattened)."""

    index: int
    param_offset: int
    shard_offset: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Layout of one flat buffer over `world` ranks. Build it with `FlatLayout.build`."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    world: int
    shard_numel: int

    @staticmethod
    def build(shapes: Sequence[torch.Size | Sequence[int]], world: int, align: int = 16) -> "FlatLayout":
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        sizes = [torch.Size(s) for s in shapes]
        offsets, total = [], 0
        for s in sizes:
            offsets.append(total)
            total += s.numel()
        per_rank = -(-total // world)
        shard = max(align, -(-per_rank // align) * align)
        return FlatLayout(tuple(sizes), tuple(offsets), total, world, shard)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in flat-buffer coordinates."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parts of each parameter inside rank's shard, in flat order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (shape, off) in enumerate(zip(self.shapes, self.offsets)):
            start, end = max(lo, off), min(hi, off + shape.numel())
            if start < end:
                out.append(Piece(i, start - off, start - lo, end - start))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into a full (gathered) flat buffer of padded_numel elements."""
        if flat.numel() != self.padded_numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {self.padded_numel}")
        return [flat[o:o + s.numel()].view(s) for s, o in zip(self.shapes, self.offsets)]

    def flatten(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None,
                scale: float = 1.0, *, aligned: bool = True) -> torch.Tensor:
        """A new padded flat buffer holding `tensors` times `scale` (zeros in the padding).
        The scale is applied while copying: one pass over the data, not two. On the host it is
        page-aligned unless `aligned=False`: a buffer bound for the drive (an nvme grads tier)
        then needs no bounce copy, while one kept in memory is exactly its own storage, which a
        resident store can hold without copying (Store.adopt)."""
        self._check_count(tensors, "flatten")
        dtype = dtype or tensors[0].dtype
        device = tensors[0].device
        host_aligned = device.type == "cpu" and aligned
        if (scale == 1.0 and not host_aligned and (len(tensors) > 1 or self.padding)
                and all(t.dtype == dtype for t in tensors)):
            # One native call instead of three per tensor: this runs in backward's hooks, where
            # each call from Python is slow (~30 us: the compute has just flushed the caches).
            # At least two tensors (the padding counts): of one, it would return a view, not a copy.
            pad = [torch.zeros(self.padding, dtype=dtype, device=device)] if self.padding else []
            flat = torch._utils._flatten_dense_tensors([*tensors, *pad])
            # The total only (every size compared would cost a call per tensor in backward's hooks,
            # where autograd's gradients have their parameters' shapes anyway): a wrong total is
            # refused; sizes that are wrong but add up are not caught on this path.
            if flat.numel() != self.padded_numel:
                self._check_sizes(tensors, "flatten")
            return flat
        if host_aligned:
            flat = aligned_tensor(self.padded_numel, dtype, huge_pages=False)
        else:
            flat = torch.empty(self.padded_numel, dtype=dtype, device=device)
        for view, t in zip(self.views(flat), tensors):
            if t.numel() != view.numel():  # copy_ would broadcast, mul(out=) resize
                self._check_sizes(tensors, "flatten")
            if scale == 1.0:
                view.copy_(t)
            else:
                torch.mul(t, scale, out=view)
        if self.padding:
            flat[self.numel:].zero_()
        return flat

    def _check_count(self, tensors: Sequence[torch.Tensor], op: str) -> None:
        if len(tensors) != len(self.shapes):
            raise ValueError(f"FlatLayout.{op}: {len(tensors)} tensors for a layout of {len(self.shapes)}")

    def _check_sizes(self, tensors: Sequence[torch.Tensor], op: str) -> None:
        """Raise naming the first tensor whose size is not its shape's."""
        for i, (t, shape) in enumerate(zip(tensors, self.shapes)):
            if t.numel() != shape.numel():
                raise ValueError(f"FlatLayout.{op}: tensor {i} has {t.numel()} elements, its place in the "
                                 f"layout is {tuple(shape)} ({shape.numel()} elements)")

    def shard_from(self, tensors: Sequence[torch.Tensor], rank: int, out: torch.Tensor) -> torch.Tensor:
        """Copy rank's shard of `tensors` into `out` (shard_numel elements; padding zeroed)."""
        self._check_count(tensors, "shard_from")
        self._check_sizes(tensors, "shard_from")
        out.zero_()
        for p in self.pieces(rank):
            src = tensors[p.index].reshape(-1)[p.param_offset:p.param_offset + p.numel]
            out[p.shard_offset:p.shard_offset + p.numel].copy_(src)
        return out

    def scatter_into(self, shard: torch.Tensor, rank: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copy rank's shard back into the matching parts of `tensors` (the inverse of shard_from)."""
        for p in self.pieces(rank):
            dst = tensors[p.index].view(-1)[p.param_offset:p.param_offset + p.numel]
            dst.copy_(shard[p.shard_offset:p.shard_offset + p.numel])
