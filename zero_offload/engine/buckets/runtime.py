"""Stages 0-2 behind the runtime interface the Engine drives (engine/runtime.py's `Runtime`;
stage 3 provides the same methods).

The runtime owns what differs between stages: how gradients become grad shards (grads.py), the
ShardOptimizer those shards go to, and how updated shards become the compute copy again (stage
0: in place; stage 1-2: all-gather of the updated shards). It also describes its shards for
checkpoints (`shard_map`) so checkpoint.py never looks inside a stage.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterator, Mapping

import torch
from torch import nn

from zero_offload import comm
from zero_offload.config import Config
from zero_offload.engine.step.accumulate import Accumulator
from zero_offload.engine.buckets.grads import Bucket, GradReducer, make_buckets
from zero_offload.engine.step.shard_optimizer import DTYPES, ShardOptimizer
from zero_offload.engine.model.attributes import check_bindings, param_bindings
from zero_offload.engine.runtime import FROZEN_ROW, FlatSource, RuntimeBase, close_in_order, consolidate, pieces_of
from zero_offload.engine.step.pipeline import hands_over_master

UPDATED_ROW = "updated weights awaiting step()"  # host copies are pinned where CUDA is


class BucketRuntime(RuntimeBase):
    """ZeRO stages 0-2: full compute copy on every rank, optimizer state (and grads) partitioned."""

    def __init__(self, model: torch.nn.Module, config: Config, device: torch.device) -> None:
        self.config = config
        self.module = model
        self.device = device
        self.world, self.rank = comm.world_size(), comm.rank()
        self.dtype = DTYPES[config.precision.dtype]
        self.replicated = config.stage == 0
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]  # the memory report's row
        self.bindings = param_bindings(model)
        self.buckets = make_buckets(named[::-1], config.bucket_bytes, 1 if self.replicated else self.world)
        opt_bytes = sum(b.layout.shard_numel for b in self.buckets) * 4
        self.shard_optimizer = ShardOptimizer(config, device, self._on_updated,
                                              capacity_bytes=opt_bytes * 4 + (1 << 20))
        self.accumulator: Accumulator | None = None
        self.reducer: GradReducer | None = None
        try:
            self._build(config, device, opt_bytes)
        except BaseException:  # a full drive, a bad tier: what was made goes (threads, files, locks)
            self.close()
            raise

    def _build(self, config: Config, device: torch.device, opt_bytes: int) -> None:
        self.owner = 0 if self.replicated else self.rank
        for b in self.buckets:
            self.shard_optimizer.add_shard(b.key, self._shard_of(b, torch.float32, self.owner))
        accumulates = config.gradient_accumulation_steps > 1  # else nothing is ever held there: a token file
        self.accumulator = Accumulator.on_grads_tier(config, device, self.rank,
                                                     {b.key: len(b.params) for b in self.buckets},
                                                     opt_bytes + (1 << 20) if accumulates else (1 << 20))
        scale = 1.0 / (self.world * config.gradient_accumulation_steps)
        self.reducer = GradReducer(self.buckets, partitioned=not self.replicated,
                                   accumulate_shard=config.stage == 2, accumulator=self.accumulator,
                                   dtype=self.dtype, scale=scale, sink=self._sink,
                                   flat_to_drive=not self.accumulator.store.addressable)
        self._bucket = {b.key: b for b in self.buckets}
        self._to_gather: dict[str, tuple[torch.Tensor, bool]] = {}  # key -> (updated shard, owned), D > 1
        # Buckets whose parameters can take an owned updated buffer as their storage (decided
        # once, as the parameters are laid out now; the updated shards come in the compute dtype,
        # on the compute device).
        self._adoptable = {b.index for b in self.buckets
                           if all(p.is_contiguous() and p.dtype == self.dtype and p.device == device for p in b.params)}
        # Each parameter's (version, address) as the engine last wrote it: a change between
        # steps is the user's (load_state_dict, an in-place edit), see _take_edits.
        self._stamps = {b.index: _stamps(b) for b in self.buckets}
        # Each parameter's dtype as initialize placed it: the compute dtype, or complex64 for a
        # complex parameter (held as float32 pairs, precision.refuse_unheld).
        self._held_dtypes = {b.index: [p.dtype for p in b.params] for b in self.buckets}

    def _shard_of(self, b: Bucket, dtype: torch.dtype, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of bucket `b` as its parameters hold it now, in `dtype`."""
        out = torch.empty(b.layout.shard_numel, dtype=dtype, device=self.device)
        return b.layout.shard_from([p.detach() for p in b.params], rank, out)

    def begin_backward(self, boundary: bool) -> None:
        check_bindings(self.bindings)  # a parameter replaced, frozen or unfrozen since initialize
        self._take_edits()
        self.reducer.begin(boundary)

    def _take_edits(self) -> None:
        """Parameters changed since the engine last wrote them (`module.load_state_dict`, an
        in-place edit, `p.data = ...`) become their bucket's master shard, moments kept, as
        torch optimizers step whatever the parameter holds; without this the next step would
        overwrite the edit with the update of the old master. In bf16/fp16 the master takes the
        edited compute copy's values. A stale .grad (left by a refused loss.backward(), or held
        before initialize) is dropped: engine.step() clears gradients, so none may carry over."""
        stamps = {b.index: _stamps(b) for b in self.buckets}  # a re-seed writes no parameter
        for b in self.buckets:
            for p in b.params:
                p.grad = None
            if stamps[b.index] != self._stamps[b.index]:
                self._reseed(b)
        self._stamps = stamps

    def _reseed(self, b: Bucket) -> None:
        for name, p, shape, held in zip(b.names, b.params, b.layout.shapes, self._held_dtypes[b.index]):
            if p.shape != shape or p.dtype != held or p.device != self.device:
                raise RuntimeError(f"engine.backward: parameter '{name}' was replaced by a tensor of shape "
                                   f"{tuple(p.shape)}, {p.dtype} on {p.device} after initialize; the engine holds "
                                   f"{tuple(shape)}, {held} on {self.device}")
        self.shard_optimizer.take_edit(b.key, self._shard_of(b, torch.float32, self.owner))

    def end_backward(self) -> None:
        self.reducer.end()

    def backward_touched(self) -> bool:
        """After a failed backward: whether a bucket had begun its reduction."""
        return self.reducer.touched()

    def abort_backward(self) -> None:
        """After a failed backward: no more buckets are reduced; the shards already handed to
        the step are finished as after a failed step."""
        self.reducer.abort()
        try:
            self.shard_optimizer.abandon_step()
        finally:
            self._to_gather.clear()  # D > 1: installed only after a whole step, which this was not
            self._stamp_all()

    def refuse_compiled(self, module: nn.Module) -> None:
        """Nothing to refuse: stages 0-2 run a compiled model (their hooks are on gradients)."""

    def gathers_updates(self) -> bool:
        """Stages 1-2 with D > 1: updated shards reach the compute copy only by the all-gathers
        at the end of a whole step (an interrupt skips them)."""
        return not self.replicated and self.world > 1

    @contextlib.contextmanager
    def gathered(self, params: list[nn.Parameter], modify: bool) -> Iterator[None]:
        """Parameters are whole anyway; with `modify` at D > 1 rank 0's values become every
        rank's when the block ends (the next backward takes them as edits, _take_edits)."""
        yield
        if modify and self.world > 1:
            with torch.no_grad():
                for p in params:
                    values = p.detach().clone()
                    p.copy_(comm.broadcast_(values, 0))

    def _sink(self, bucket: Bucket, shard: torch.Tensor, missing: list[tuple[int, int]] | tuple = ()) -> None:
        self.shard_optimizer.grad_ready(bucket.key, shard, owned=True, missing=missing)

    def _on_updated(self, key: str, shard: torch.Tensor, owned: bool) -> None:
        """An updated shard, as soon as finish_step has it (backward is over: nothing reads the
        parameters until the next forward). A bucket whose shard is this rank's alone is
        installed at once, while the worker steps the last shards; one that must be all-gathered
        (stages 1-2, D > 1) waits for the whole step to succeed, so that every rank issues the
        same all-gathers in bucket order even when a step fails part way."""
        # From pinned host memory this upload is asynchronous on the current stream, ordered
        # before the next forward; the host buffer is not reused before then (see step.py).
        # Already on the device in the compute dtype, the shard is used as it is: it is
        # installed before anything (the next step's Adam) can modify it.
        moved = shard.to(self.device, self.dtype, non_blocking=True)
        b, owned = self._bucket[key], owned or moved is not shard
        if b.layout.world > 1:
            self._to_gather[key] = (moved, owned)
        else:
            self._install(b, moved, owned)

    def step(self) -> bool:
        """Finish the optimizer step and bring the compute copy up to date; False if skipped."""
        try:
            try:
                applied = self.shard_optimizer.finish_step(defer_interrupt=True)
            except Exception:  # agreed on every rank (an interrupt is not: it leaves at once)
                self._install_partial_step()
                raise
            for b in self.buckets:
                if b.key in self._to_gather:
                    self._install(b, *self._to_gather[b.key])
        finally:
            self._to_gather.clear()
            self._stamp_all()
        self.shard_optimizer.prefetch()  # after the installs: its thread would compete for the GIL
        return applied

    def _install_partial_step(self) -> None:
        """After a step that failed on some rank (stages 1-2, D > 1): the shards each rank did
        step keep their update (finish_step), so the compute copy must follow them, as it does at
        D = 1 where each is installed as it finishes. Every rank all-gathers every bucket, in
        order: its updated shard where it stepped one, else its shard of the compute copy as it
        stands (what its master holds, in the compute dtype); nothing is read from the store,
        which may be what failed."""
        if all(b.layout.world == 1 for b in self.buckets):
            return
        for b in self.buckets:
            shard, owned = self._to_gather.get(b.key, (None, True))
            if shard is None:
                shard = self._shard_of(b, self.dtype, self.rank)
            self._install(b, shard, owned)

    def _install(self, b: Bucket, shard: torch.Tensor, owned: bool = False) -> None:
        """Compute copy of bucket `b` from this rank's updated shard (all-gathered at stage 1-2).

        A flat buffer nobody else holds (`owned`: a fresh copy from the step, or the all-gather's
        output) becomes the parameters' storage, which costs nothing; the store's own master
        tensor, which the next step modifies in place, is copied instead."""
        full = shard
        if b.layout.world > 1:
            full = torch.empty(b.layout.padded_numel, dtype=self.dtype, device=self.device)
            comm.all_gather_(full, shard)
            owned = True
        if owned and b.index in self._adoptable:  # as step() runs after backward: few calls
            for p, v in zip(b.params, b.layout.views(full)):
                p.data = v
        else:
            with torch.no_grad():
                for p, v in zip(b.params, b.layout.views(full)):
                    p.copy_(v)

    def _stamp_all(self) -> None:
        """After the engine's own writes to the parameters: every bucket at once, since one
        bucket's install can bump the version counter of another's parameters (views of one base
        tensor share it)."""
        self._stamps = {b.index: _stamps(b) for b in self.buckets}

    def refresh_params(self) -> None:
        """Rebuild the compute copy from the master shards (after a checkpoint load)."""
        for b in self.buckets:
            self._install(b, self.shard_optimizer.master(b.key).to(self.device, self.dtype))
        self._stamp_all()

    def shard_map(self) -> dict[str, list[tuple[str, int, int, int]]]:
        return {b.key: pieces_of(b.names, b.layout, self.owner) for b in self.buckets}

    def frozen_map(self) -> dict[str, list[tuple[str, int, int, int]]]:
        """No frozen state outside the module at stages 0-2: frozen parameters stay in the model
        (checkpoints save them with the buffers)."""
        return {}

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}

    def read_frozen(self, key: str) -> torch.Tensor:
        raise KeyError(f"stages 0-2 keep no frozen shard {key!r}: frozen parameters stay in the module")

    def write_frozen(self, key: str, values: torch.Tensor) -> None:
        raise KeyError(f"stages 0-2 keep no frozen shard {key!r}: frozen parameters stay in the module")

    def shards_frozen(self) -> bool:
        """Frozen parameters stay in the module (model.pt of a checkpoint)."""
        return False

    def held_params(self) -> set[int]:
        """Every parameter is whole in the module."""
        return set()

    def flat_sources(self) -> list[FlatSource]:
        """Each bucket, its values from the fp32 master shard."""
        so = self.shard_optimizer
        return [FlatSource(b.layout, b.params, torch.float32, partial(so.master, b.key)) for b in self.buckets]

    def consolidated(self, orig_dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """Full fp32 weights on rank 0 (buffers and frozen parameters in their original dtype);
        {} on other ranks. A collective at stages 1-2 (each bucket's master is all-gathered)."""
        return consolidate(self.module, self.flat_sources(), self.device, keep=self.rank == 0, orig_dtypes=orig_dtypes)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(p.shape) for b in self.buckets for n, p in zip(b.names, b.params)}

    def trainable_numel(self) -> int:
        """Elements of master and moments: a complex parameter's values count twice (its pairs)."""
        return sum(b.layout.entry_numel(i) for b in self.buckets for i in range(len(b.params)))

    def retained(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(bytes held now, high-water mark) of the engine's own allocations, by (group, tier)."""
        weights = sum(p.numel() * p.element_size() for b in self.buckets for p in b.params)
        return {("weights", self.config.tiers.params): (weights, weights), **self.state_retained()}

    def extras(self) -> dict[str, float]:
        """Bytes outside the ledger's groups, named (see memory.py)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        # Every updated shard waits at step() in a buffer of its own, unless the master is it.
        copies = not hands_over_master(self.shard_optimizer.store.addressable, self.dtype)
        return {**self.state_extras({b.key: b.layout for b in self.buckets}),
                "gradient bucket in flight (largest)": max(b.layout.padded_numel for b in self.buckets) * elem,
                UPDATED_ROW: sum(b.layout.shard_numel for b in self.buckets) * elem if copies else 0,
                FROZEN_ROW: sum(p.numel() * p.element_size() for _, p in self.frozen)}

    def limits(self) -> dict[str, int]:
        """Configured bounds shown apart in the memory report: none at stages 0-2."""
        return {}

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.remove()
        close_in_order([self.shard_optimizer.close], [self.accumulator])


def _stamps(b: Bucket) -> list[tuple[int, int]]:
    """(version counter, address) of each of the bucket's parameters: an in-place change bumps
    the first, a `p.data = ...` changes the second; `.data` assignments by the engine itself
    are followed by a new stamp."""
    return [(p._version, p.data_ptr()) for p in b.params]
