"""Stage 0-2 gradients: buckets, the hooks that fill them, and the reduction into grad shards.

Trainable parameters are grouped, in reverse registration order (roughly the order backward
produces their gradients), into buckets of at most `bucket_bytes`, small parameters apart (see
make_buckets). Each bucket is a flat buffer
(partition.FlatLayout). When the last gradient of a bucket has been accumulated, the bucket is
flattened, scaled by 1/(D x accumulation steps) and reduced: at stage 0 all-reduced whole (every
rank steps every bucket), at stages 1-2 reduce-scattered so each rank gets its grad shard.
Buckets are reduced strictly in index order, so every rank issues the same collectives in the
same order even when a parameter gets no gradient (it counts as zero, filled in at the end).

A parameter without a gradient (on every rank, in every micro-batch of the cycle) is not stepped,
as torch's optimizers skip a .grad of None. Only a bucket incomplete on this rank can hold one:
a bucket complete here has a gradient for every parameter on every rank after the reduction, so
it goes to the step as soon as it is reduced (the overlapped step). An incomplete one waits for
the end of backward, where the ranks agree on which parameters no rank had a gradient for
(Accumulator.agree: one small all-reduce at D > 1, none at D = 1), and goes to the step with
those parameters' element ranges left out.

Gradient accumulation (accumulate.Accumulator): between boundaries, stage 0/1 adds the whole flat
bucket into an accumulation buffer on the grads tier; stage 2 reduce-scatters every micro-batch and accumulates
only its grad shard (that is the stage-2 saving). On the boundary micro-batch the reduced shard
goes straight to `sink` (the step), with no buffer at all when there is no accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from zero_offload import comm
from zero_offload.engine.step.accumulate import Accumulator, missing_ranges
from zero_offload.partition import FlatLayout


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    layout: FlatLayout
    ready: set[int] = field(default_factory=set)

    @property
    def key(self) -> str:
        return f"bucket{self.index}"


SMALL_FRACTION = 16  # a parameter under bucket_bytes / 16, and under SMALL_MAX, is "small"
SMALL_MAX = 1 << 20  # (see make_buckets): biases and norms, not a large model's weight matrices


def make_buckets(named: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int, world: int) -> list[Bucket]:
    """Greedy buckets over `named` (already in backward order), each at most bucket_bytes unless
    a single parameter is larger.

    Small parameters (biases, norms: under bucket_bytes / SMALL_FRACTION and SMALL_MAX) go into
    one bucket of their own after the large ones. Interleaved with the weights they would either
    cut the weights' buckets short (a bucket of one bias costs a reduction, an optimizer job and an
    NVMe slot read and write of a few KiB) or join a weight's bucket and force a flatten copy of
    it. Their gradients wait for the end of backward, so at most one bucket's worth is held back:
    small parameters beyond that stay where backward order puts them."""
    small = min(bucket_bytes // SMALL_FRACTION, SMALL_MAX)
    held, rest, trailing = 0, [], []
    for name, p in named:
        nbytes = p.numel() * p.element_size()
        if nbytes < small and held + nbytes <= bucket_bytes:
            held += nbytes
            trailing.append((name, p))
        else:
            rest.append((name, p))
    groups = _greedy(rest, bucket_bytes) + _greedy(trailing, bucket_bytes)  # trailing: one bucket at most
    return [Bucket(i, [p for _, p in g], [n for n, _ in g],
                   FlatLayout.build([p.shape for _, p in g], world, pairs=[p.is_complex() for _, p in g]))
            for i, g in enumerate(groups)]


def _greedy(named: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    size = 0
    for name, p in named:
        nbytes = p.numel() * p.element_size()
        if not groups or (groups[-1] and size + nbytes > bucket_bytes):
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += nbytes
    return groups


class GradReducer:
    """Owns the bucket hooks and reductions of one model; hands each grad shard to `sink`."""

    def __init__(self, buckets: list[Bucket], *, partitioned: bool, accumulate_shard: bool,
                 accumulator: Accumulator, dtype: torch.dtype, scale: float,
                 sink: Callable[..., None], flat_to_drive: bool = False) -> None:
        """`sink(bucket, grad shard)` takes each reduced grad shard on the boundary; one with
        parameters that got no gradient comes as `sink(bucket, grad shard, missing)`, with the
        element ranges of the shard that hold them."""
        self.buckets = buckets
        self.partitioned = partitioned  # reduce-scatter (stage 1-2) or all-reduce (stage 0)
        self.accumulate_shard = accumulate_shard  # stage 2: accumulate after reduce-scatter
        self.accumulator = accumulator
        self.dtype = dtype
        self.scale = scale
        self.sink = sink
        self.flat_to_drive = flat_to_drive  # the grads store is a drive: flat buffers page-aligned for it
        self.rank = comm.rank()
        self.active = False
        self.boundary = True
        self._next = 0
        self._launching = False
        self._slot = {id(p): (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._waiting: list[tuple[Bucket, torch.Tensor]] = []  # reduced, incomplete here: for the agreement
        self._direct = {b.index for b in buckets
                        if len(b.params) == 1 and b.layout.padding == 0 and b.params[0].dtype == dtype}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for b in buckets for p in b.params]

    def begin(self, boundary: bool) -> None:
        self.active, self.boundary, self._next, self._launching = True, boundary, 0, False
        for b in self.buckets:
            b.ready.clear()

    def end(self) -> None:
        """After backward: reduce every bucket still waiting (parameters without a gradient), in
        order; on the boundary agree on what got no gradient, then hand on the buckets that were
        incomplete here."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        if self.boundary:
            agreed = self.accumulator.agree()
            waiting, self._waiting = self._waiting, []
            owner = 0 if not self.partitioned else self.rank
            for b, shard in waiting:
                self.sink(b, shard, missing_ranges(b.layout, owner, agreed.get(b.key, ())))
        self.active = False

    def touched(self) -> bool:
        """Whether a bucket has begun its reduction this backward (a launch that failed part way
        may already have taken its partial sum)."""
        return self._next > 0 or self._launching

    def abort(self) -> None:
        """After a failed backward: the gradients not yet reduced are dropped, so nothing more
        reaches the step."""
        for b in self.buckets[self._next:]:
            b.ready.clear()
            for p in b.params:
                p.grad = None
        if self.touched():  # a cycle that took part of this backward is not gone on with
            self.accumulator.forget_cycle()
        self._waiting = []
        self.active = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.active:
            raise RuntimeError("a gradient arrived outside engine.backward(): call engine.backward(loss), "
                               "not loss.backward()")
        bucket, i = self._slot[id(p)]
        bucket.ready.add(i)
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _flatten(self, b: Bucket) -> torch.Tensor:
        """The bucket's gradients as one scaled flat buffer; the parameters' .grad are released.

        A bucket of one parameter without padding, in the gradient dtype (`_direct`, decided
        once: this runs in backward's hooks, where each line is slow), needs no copy: autograd's
        gradient tensor, which nothing else references once .grad is cleared, is the flat buffer."""
        if b.index in self._direct:
            p = b.params[0]
            g, p.grad = p.grad, None
            if g is not None and g.is_contiguous():
                return g.view(-1) if self.scale == 1.0 else g.view(-1).mul_(self.scale)
            grads = [g if g is not None else torch.zeros_like(p)]
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            for p in b.params:
                p.grad = None
        return b.layout.flatten(grads, dtype=self.dtype, scale=self.scale, aligned=self.flat_to_drive)

    def _launch(self, b: Bucket) -> None:
        self._launching = True  # cleared by begin(): from here on a failure may have consumed state
        n = len(b.params)
        self.accumulator.note(b.key, [i for i in range(n) if i not in b.ready] if len(b.ready) < n else ())
        flat = self._flatten(b)
        if not self.accumulate_shard:
            flat = self.accumulator.add(b.key, flat, self.boundary)
            if flat is None:
                return
        shard = self._reduce(b, flat)
        del flat
        if self.accumulate_shard:
            shard = self.accumulator.add(b.key, shard, self.boundary)
            if shard is None:
                return
        if self.accumulator.lacks(b.key):  # maybe no gradient on any rank: wait for the agreement
            self._waiting.append((b, shard))
        else:
            self.sink(b, shard)

    def _reduce(self, b: Bucket, flat: torch.Tensor) -> torch.Tensor:
        if not self.partitioned or b.layout.world == 1:  # D = 1: the flat buffer is the shard
            return comm.all_reduce_(flat)
        shard = torch.empty(b.layout.shard_numel, dtype=flat.dtype, device=flat.device)
        return comm.reduce_scatter_(shard, flat)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
