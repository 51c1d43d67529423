"""Flat buffers and shards: where each parameter's elements sit, and which rank owns them.

A flat buffer lays a group of parameters out contiguously, in a fixed order, padded at the end so
it splits into D equal shards. Rank r owns elements [r*S, (r+1)*S) with S = padded_numel / D; all
optimizer state is kept per shard. A parameter may straddle two shards; `pieces(rank)` lists the
parts of each parameter that fall in one rank's shard, which is all the engine needs to copy
between per-parameter tensors and shards.

Padding is extra alignment too: each shard's numel is rounded up to `align` elements so that
shards and NVMe slots start on whole vector widths.

A complex parameter is held as its real/imaginary pairs (`pairs`: torch.view_as_real's layout, 2
elements per value, at an even offset so that `views` can give it back as torch.view_as_complex),
which is how torch's AdamW steps it: its master, moments and gradient are real elements like any
other, and all coordinates here (offsets, pieces, numel) count real elements. An odd offset skipped
for that is a gap that `flatten` zeroes, as it does the padding.
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
    pairs: tuple[bool, ...] = ()  # per entry: a complex value held as (real, imag) pairs; () is none
    gaps: bool = False  # an entry's offset was rounded up to even, leaving an element no entry holds

    @staticmethod
    def build(shapes: Sequence[torch.Size | Sequence[int]], world: int, align: int = 16,
              pairs: Sequence[bool] = ()) -> "FlatLayout":
        if world < 1:
            raise ValueError(f"world size must be >= 1, got {world}")
        sizes = [torch.Size(s) for s in shapes]
        flags = tuple(bool(f) for f in pairs) if any(pairs) else ()
        if flags and len(flags) != len(sizes):
            raise ValueError(f"FlatLayout.build: {len(flags)} pair flags for {len(sizes)} shapes")
        offsets, total, gaps = [], 0, False
        for i, s in enumerate(sizes):
            if flags and flags[i] and total % 2:
                total, gaps = total + 1, True  # view_as_complex needs an even storage offset
            offsets.append(total)
            total += s.numel() * (2 if flags and flags[i] else 1)
        per_rank = -(-total // world)
        shard = max(align, -(-per_rank // align) * align)
        return FlatLayout(tuple(sizes), tuple(offsets), total, world, shard, flags, gaps)

    def entry_numel(self, i: int) -> int:
        """Elements entry `i` takes in the flat buffer (a complex one's values twice over)."""
        return self.shapes[i].numel() * (2 if self.pairs and self.pairs[i] else 1)

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
        for i, off in enumerate(self.offsets):
            start, end = max(lo, off), min(hi, off + self.entry_numel(i))
            if start < end:
                out.append(Piece(i, start - off, start - lo, end - start))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views into a full (gathered) flat buffer of padded_numel elements (a
        complex entry's as torch.view_as_complex of its pairs: the parameter's own shape and kind)."""
        if flat.numel() != self.padded_numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, layout needs {self.padded_numel}")
        if not self.pairs:
            return [flat[o:o + s.numel()].view(s) for s, o in zip(self.shapes, self.offsets)]
        return [torch.view_as_complex(flat[o:o + 2 * s.numel()].view(*s, 2)) if pair else flat[o:o + s.numel()].view(s)
                for s, o, pair in zip(self.shapes, self.offsets, self.pairs)]

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
        if (scale == 1.0 and not host_aligned and (len(tensors) > 1 or self.padding) and not self.pairs
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
        if self.gaps:
            flat.zero_()  # the elements skipped to put a complex entry at an even offset
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
            src = _elements(tensors[p.index]).reshape(-1)[p.param_offset:p.param_offset + p.numel]
            out[p.shard_offset:p.shard_offset + p.numel].copy_(src)
        return out

    def scatter_into(self, shard: torch.Tensor, rank: int, tensors: Sequence[torch.Tensor]) -> None:
        """Copy rank's shard back into the matching parts of `tensors` (the inverse of shard_from)."""
        for p in self.pieces(rank):
            dst = _elements(tensors[p.index]).view(-1)[p.param_offset:p.param_offset + p.numel]
            dst.copy_(shard[p.shard_offset:p.shard_offset + p.numel])


def _elements(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the flat buffer counts its elements: a complex one as its (real, imag) pairs."""
    return torch.view_as_real(t) if t.is_complex() else t
