"""One unit: parameters gathered and released together, and the transfers that move its shard.

A unit keeps one flat buffer per parameter group (trainable and frozen parameters go in separate
groups, so the optimizer never sees a frozen parameter). Between uses only this rank's shard of
the compute copy exists, on the params tier, in a Store under the group's key.

Gathering and releasing. Each group's full flat buffer is ONE tensor for the unit's lifetime; the
unit frees its bytes by resizing that tensor's storage to 0 and re-allocates them by resizing it
back before a gather. While gathered, every parameter's `.data` is a view of the flat buffer;
while sharded it is an empty tensor (so `model.parameters()` is safe to touch, it just has 0
elements). Why this pair of techniques: autograd saves some parameters as views made in forward
(`weight.t()` for a Linear); such a view keeps pointing at the flat buffer's storage, so when the
unit is gathered again for backward (same storage, re-filled) the saved view reads the right
values, and while sharded that storage holds no bytes. Swapping `.data` keeps the nn.Parameter
objects themselves, so tied weights stay one object and optimizers/hooks keyed by parameter work.

State machine (owned here, transitions raise unless in the state they leave):
    SHARDED --begin_fetch--> FETCHING --finish_gather--> GATHERED --release--> SHARDED
    FETCHING --abandon--> SHARDED   (a prefetch that turned out not to be needed)
`fetch_local` (this rank's shard: tier -> gather buffer -> device part, or straight from the
values of a write of that shard still in flight) may run on a background thread; `finish_gather`
(the all-gather) always runs on the main thread, in execution order, so every rank issues the
same collectives in the same order. `gather` is the whole of it now, on the calling thread (a
resident unit, engine.gathered); the prefetcher fetches with `fetch` and all-gathers later.

A unit's part in the current pass (how many calls hold it, how far its backward has come:
UnitBackward) is a UnitPass, which the runtime keeps beside the unit and renews each pass.
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from zero_offload import comm
from zero_offload.engine.step.pipeline import updated_buffer
from zero_offload.partition import FlatLayout
from zero_offload.store.base import Handle, Store
from zero_offload.store.resident import copy_async
from zero_offload.trace import tracer


class UnitState(enum.Enum):
    SHARDED = "sharded"
    FETCHING = "fetching"
    GATHERED = "gathered"


@dataclass
class FlatGroup:
    """One flat buffer of a unit: the parameters that share `trainable`."""

    key: str
    trainable: bool
    names: list[str]
    params: list[nn.Parameter]
    layout: FlatLayout
    flat: torch.Tensor  # the full flat buffer; its storage holds 0 bytes while sharded

    @property
    def nbytes(self) -> int:
        return self.layout.padded_numel * self.flat.element_size()


class GatherBuffers:
    """Reusable bounce buffers for a gather's local read (drive -> buffer -> device part), per
    (numel, dtype), made by the store (aligned/pinned as it needs). Not the optimizer's
    staging ring (engine/step/staging_ring.py), which reads optimizer state ahead of the step.

    Buffers return here after each transfer, so this holds as many of a size as there were
    transfers of that size in flight at once (two: the prefetch thread and the main thread).
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.setdefault((numel, dtype), [])
            if free:
                return free.pop()
        buf = self.store.staging_buffer(numel, dtype)
        with self._lock:
            self.nbytes += buf.numel() * buf.element_size()
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype), []).append(buf)


class Unit:
    """Parameters gathered and released together; see the module docstring."""

    def __init__(self, index: int, name: str, named_params: list[tuple[str, nn.Parameter, torch.Size]], *,
                 dtype: torch.dtype, device: torch.device, store: Store, staging: GatherBuffers) -> None:
        self.index, self.name = index, name
        self.dtype, self.device = dtype, torch.device(device)
        self.store, self.buffers = store, staging  # `staging`: the keyword callers (and tests) pass
        self.world, self.rank = comm.world_size(), comm.rank()
        self.state = UnitState.SHARDED
        self.resident = False
        self.groups: list[FlatGroup] = []
        for trainable in (True, False):
            chosen = [(n, p, s) for n, p, s in named_params if p.requires_grad == trainable]
            if chosen:
                self.groups.append(self._make_group(chosen, trainable))
        self._has_pairs = any(g.layout.pairs for g in self.groups)  # complex parameters held as float pairs
        self._pending: Callable[[], None] | None = None
        self._writes: dict[str, tuple[Handle, torch.Tensor]] = {}  # writes in flight and their values, by group key
        self._write_lock = threading.Lock()
        self._sharded_versions: dict[int, int] = {}  # id(param) -> version counter when last emptied
        self._gathered_marks: dict[int, tuple[int, int]] = {}  # id(param) -> (version, address) as gathered

    def _make_group(self, named: list[tuple[str, nn.Parameter, torch.Size]], trainable: bool) -> FlatGroup:
        layout = FlatLayout.build([s for _, _, s in named], self.world, pairs=[p.is_complex() for _, p, _ in named])
        flat = torch.empty(layout.padded_numel, dtype=self.dtype, device=self.device)
        flat.untyped_storage().resize_(0)
        key = f"unit{self.index}.{'trainable' if trainable else 'frozen'}"
        self.store.allocate(key, layout.shard_numel, self.dtype)
        return FlatGroup(key, trainable, [n for n, _, _ in named], [p for _, p, _ in named], layout, flat)

    # ---- sizes ----
    @property
    def nbytes(self) -> int:
        """Bytes of the gathered compute copy (padding included): what the live budget counts."""
        return sum(g.nbytes for g in self.groups)

    @property
    def trainable(self) -> FlatGroup | None:
        return self.groups[0] if self.groups and self.groups[0].trainable else None

    def params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    # ---- state machine ----
    def _leave(self, state: UnitState, transition: str) -> None:
        if self.state is not state:
            raise RuntimeError(f"unit '{self.name}': {transition} needs state {state.value}, it is {self.state.value}")

    def begin_fetch(self) -> None:
        """SHARDED -> FETCHING: allocate the flat buffers; `fetch_local` then fills this rank's part."""
        self._leave(UnitState.SHARDED, "begin_fetch")
        for g in self.groups:
            g.flat.untyped_storage().resize_(g.layout.padded_numel * g.flat.element_size())
        self.state = UnitState.FETCHING

    def fetch(self) -> None:
        """SHARDED -> FETCHING with this rank's shard in its part, read on this thread."""
        self.begin_fetch()
        self.fetch_local()

    def gather(self) -> None:
        """SHARDED -> GATHERED now, on this thread (a collective: every rank gathers the unit)."""
        self.fetch()
        self.finish_gather()

    def set_pending(self, wait: Callable[[], None]) -> None:
        """`wait()` finishes the background fetch_local of this unit (re-raising its error)."""
        self._pending = wait

    def fetch_local(self) -> None:
        """Copy this rank's shard of every group from its tier into its part of the flat buffer."""
        if self.state is not UnitState.FETCHING:
            raise RuntimeError(f"unit '{self.name}': fetch_local needs state fetching, it is {self.state.value}")
        with tracer().span(f"fetch {self.name}", "transfer", bytes=self.nbytes // self.world):
            for g in self.groups:
                lo, hi = g.layout.shard_range(self.rank)
                self._read_shard(g.key, g.flat[lo:hi])

    def _read_shard(self, key: str, part: torch.Tensor) -> None:
        pending = self._pending_write(key)
        if pending is not None:  # the shard's newest values are still being written: take them from memory
            copy_async(part, pending).wait()
            return
        self.settle_write(key)
        if self.store.view(key) is not None:  # resident tier: one (possibly host->device) copy
            self.store.read(key, part).wait()
            return
        buf = self.buffers.acquire(part.numel(), part.dtype)  # nvme -> bounce buffer -> device
        try:
            self.store.read(key, buf).wait()
            copy_async(part, buf).wait()
        finally:
            self.buffers.give_back(buf)

    def finish_gather(self) -> None:
        """FETCHING -> GATHERED: wait for the local fetch, all-gather, point the parameters at views."""
        self._leave(UnitState.FETCHING, "finish_gather")
        if self._pending is not None:
            wait, self._pending = self._pending, None
            start = time.perf_counter_ns()
            _wait_through_interrupts(wait)
            tracer().add(f"wait {self.name}", "wait", start, time.perf_counter_ns())
        for g in self.groups:
            self._all_gather(g)
        self._check_untouched()  # after the collective: every rank is past it, whichever raises
        for g in self.groups:
            for p, view in zip(g.params, g.layout.views(g.flat)):
                p.data = view
        self.note_gathered()
        self.state = UnitState.GATHERED

    def abandon(self) -> None:
        """FETCHING -> SHARDED without gathering (a prefetch the step did not use)."""
        self._leave(UnitState.FETCHING, "abandon")
        try:
            if self._pending is not None:  # its read must end before the buffers go, even if it failed
                wait, self._pending = self._pending, None
                _wait_through_interrupts(wait)
        finally:
            self._free_storage()
            self.state = UnitState.SHARDED

    def release(self) -> None:
        """GATHERED -> SHARDED: parameters become empty and the flat buffers give their bytes back."""
        self._leave(UnitState.GATHERED, "release")
        self._free_storage()
        self.state = UnitState.SHARDED

    # ---- writes to gathered parameters ----
    def note_gathered(self) -> None:
        """Remember each parameter's version counter and address as it is now: an in-place write
        after this (a renorm in forward, an EMA update of a frozen copy, `p.data = t`) is what
        `edited_groups` finds."""
        self._gathered_marks = {id(p): (p._version, p.data_ptr()) for p in self.params()}

    def edited(self) -> bool:
        """Whether any parameter was written in place or given new storage since `note_gathered`
        (checked at every call exit of a pass: a short-circuiting scan, no list)."""
        marks = self._gathered_marks
        return any(marks.get(id(p)) != (p._version, p.data_ptr()) for g in self.groups for p in g.params)

    def edited_names(self, g: FlatGroup) -> list[str]:
        """The parameters of `g` written in place or given new storage since `note_gathered`."""
        return [n for n, p in zip(g.names, g.params) if self._gathered_marks.get(id(p)) != (p._version, p.data_ptr())]

    def take_replaced(self, g: FlatGroup) -> None:
        """A parameter given new storage while gathered (`p.data = t`) is copied into its view of
        the flat buffer and pointed back at it; in-place edits are there already."""
        for name, p, view in zip(g.names, g.params, g.layout.views(g.flat)):
            if p.data_ptr() == view.data_ptr():
                continue
            if p.shape != view.shape:
                raise RuntimeError(f"stage 3: parameter '{name}' of unit '{self.name}' was given shape "
                                   f"{tuple(p.shape)}; it has {tuple(view.shape)}")
            view.copy_(p.detach())
            p.data = view

    def keep_aliases(self) -> None:
        """A tensor taken from a gathered parameter (`p.detach()`, `p.data`, a view) shares its
        group's flat buffer, whose storage release frees: reading it afterwards read freed memory
        and crashed the process. Where such a tensor exists (the storage has more users than the
        flat buffer and its parameters), the group moves on to a new flat buffer and the old
        storage is left to those tensors, values and all, as eager torch keeps a weight one holds.
        Only outside a pass: there, autograd's saved tensors are users too, and must see the re-gather."""
        for g in self.groups:
            storage = g.flat.untyped_storage()
            if torch._C._storage_Use_Count(storage._cdata) > 2 + len(g.params):  # + `storage` itself
                fresh = torch.empty(g.layout.padded_numel, dtype=g.flat.dtype, device=g.flat.device)
                fresh.untyped_storage().resize_(0)
                g.flat = fresh

    def _free_storage(self) -> None:
        self.empty_params()
        for g in self.groups:
            g.flat.untyped_storage().resize_(0)

    def empty_params(self) -> None:
        """Point every parameter at an empty tensor (sharded) and remember its version counter:
        a change made while sharded (`p.data = t`, an in-place edit, a parametrization's
        `set_`) would be overwritten by the next gather without a word; _check_untouched refuses it."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        pairs = torch.empty(0, dtype=empty.dtype.to_complex(), device=self.device) if self._has_pairs else empty
        for g in self.groups:
            for i, p in enumerate(g.params):
                p.data = pairs if g.layout.pairs and g.layout.pairs[i] else empty  # a complex one stays complex
                self._sharded_versions[id(p)] = p._version

    def _check_untouched(self) -> None:
        """Each parameter this unit emptied is still that empty tensor, at the same version."""
        for g in self.groups:
            for name, p in zip(g.names, g.params):
                version = self._sharded_versions.get(id(p))
                if version is not None and (p.numel() or p._version != version):
                    self.empty_params()  # dropped, so that the next pass goes on from the shards
                    raise RuntimeError(f"stage 3: parameter '{name}' (unit '{self.name}') was changed while its unit "
                                       "was sharded, between passes, and the change is dropped (a gather would "
                                       "overwrite it): edit weights inside `with engine.gathered(params, modify=True)`")

    def install_shards(self, shards: dict[str, torch.Tensor | None], *, frozen_too: bool = False) -> None:
        """A GATHERED (resident) unit takes new shards in place: given ones are copied into this
        rank's part, missing ones (None) are read from the store; then the all-gather (collective).
        Frozen groups are skipped unless `frozen_too` (after a checkpoint load rewrote them)."""
        if self.state is not UnitState.GATHERED:
            raise RuntimeError(f"unit '{self.name}': install_shards needs state gathered, it is {self.state.value}")
        for g in self.groups:
            lo, hi = g.layout.shard_range(self.rank)
            values = shards.get(g.key)
            if values is None and not g.trainable and not frozen_too:
                continue  # frozen values never change
            if values is None:
                self._read_shard(g.key, g.flat[lo:hi])
            else:
                copy_async(g.flat[lo:hi], values.to(self.dtype).reshape(-1)).wait()
            self._all_gather(g)

    def _all_gather(self, g: FlatGroup) -> None:
        """The other ranks' parts of `g`'s flat buffer (this rank's part is filled already)."""
        if self.world > 1:
            with tracer().span(f"all-gather {self.name}", "comm"):
                comm.all_gather_in_place_(g.flat)

    # ---- shards ----
    def write_shard(self, key: str, values: torch.Tensor, *, replacing: bool = False) -> None:
        """Start storing a new compute-copy shard of group `key` (initial weights or an optimizer
        update). It completes in the background: a fetch meanwhile copies `values` instead of
        reading the drive, read_shard and settle_writes wait for it, and an earlier write of the
        same key is finished first so writes never reorder. `values` must not change until then.
        `replacing`: the shard is being rebuilt (a checkpoint load), so an earlier failed write
        of it is waited for but not raised: this write supersedes it."""
        src = values.reshape(-1)
        if src.dtype != self.dtype:  # into a page-aligned host buffer: an nvme tier's direct path
            src = updated_buffer(src.numel(), self.dtype, src.device).copy_(src)
        with self._write_lock:
            self._settle_locked(key, quiet=replacing)
            self._writes[key] = (self.store.write(key, src), src)

    def _pending_write(self, key: str) -> torch.Tensor | None:
        """The values of `key`'s write still in flight, if any. A fetch copies them instead of
        waiting for the write and reading it back: the unit updated last in a step is the first
        one the next forward needs. The write itself goes on (and is settled as before); the
        writer never modifies a tensor after handing it to write_shard."""
        with self._write_lock:
            entry = self._writes.get(key)
            return None if entry is None else entry[1]

    def settle_write(self, key: str) -> None:
        """Finish the write of `key` in flight, if any (re-raising its failure). Thread-safe: the
        step worker writes, the prefetch thread and the main thread read."""
        with self._write_lock:
            self._settle_locked(key)

    def _settle_locked(self, key: str, *, quiet: bool = False) -> None:
        """Finish `key`'s write; its error is raised unless `quiet`. It is forgotten only once it
        has ended, failed or not: an interrupt leaves it in flight, to be settled again, so no
        reader passes a write still running."""
        entry = self._writes.get(key)
        if entry is None:
            return
        try:
            entry[0].wait()
        except Exception:
            del self._writes[key]
            if not quiet:
                raise
            return
        del self._writes[key]

    def settle_writes(self) -> None:
        """Finish every shard write in flight (re-raising the first failure)."""
        for key in list(self._writes):
            self.settle_write(key)

    def read_shard(self, key: str) -> torch.Tensor:
        self.settle_write(key)
        group = next(g for g in self.groups if g.key == key)
        out = torch.empty(group.layout.shard_numel, dtype=self.dtype)
        return self.store.read(key, out).wait()

    def reduce_grads(self, scale: float, *, aligned: bool = True) -> torch.Tensor | None:
        """This rank's grad shard of the trainable group (sum over ranks x `scale`); frees `.grad`.
        `aligned`: the flat buffer page-aligned for a drive (an nvme grads tier), or exactly its
        own storage, which a resident grads tier keeps without a copy (FlatLayout.flatten).

        Must be called on every rank in the same unit order (reduce-scatter is collective). A
        parameter that got no gradient contributes zeros, as at stages 0-2.
        """
        g = self.trainable
        if g is None:
            return None
        grads = [p.grad if p.grad is not None else torch.zeros(shape, dtype=self.dtype, device=self.device)
                 for p, shape in zip(g.params, g.layout.shapes)]
        for p in g.params:
            p.grad = None
        full = g.layout.flatten(grads, dtype=self.dtype, scale=scale, aligned=aligned)  # scaled while copying: one pass
        if self.world == 1:
            return full  # the whole flat buffer is the one shard: no copy
        shard = torch.empty(g.layout.shard_numel, dtype=self.dtype, device=self.device)
        with tracer().span(f"reduce-scatter {self.name}", "comm"):
            comm.reduce_scatter_(shard, full)
        return shard


class UnitBackward(enum.Enum):
    """How far one unit's backward has come in the current pass (UnitPass.backward)."""

    WAITING = "waiting"  # not gathered for backward yet, not finished
    HELD = "held"  # gathered again for its backward (its outputs' gradient arrived)
    FINISHED_HELD = "finished, held"  # reduced; a frozen weight may still be needed, so still gathered
    FINISHED = "finished"  # reduced (or had nothing to reduce) and not held for backward


class PassStateError(RuntimeError):
    """A stage-3 pass record was asked for a transition its state does not allow (our defect)."""


@dataclass
class UnitPass:
    """One unit's state in the current pass, beside the unit (never on its parameters); the
    runtime makes a fresh one per unit at each pass, so one reset clears them all.

    Backward: WAITING --hold--> HELD --finish--> FINISHED_HELD --let_go--> FINISHED, and
    WAITING --finish--> FINISHED (reduced at end_backward, or a frozen unit's inputs' gradient,
    without having been gathered again). A wrong transition raises PassStateError."""

    unit: Unit
    refs: int = 0  # calls in progress that acquired it, plus one while held for backward
    backward: UnitBackward = UnitBackward.WAITING
    recomputing: bool = False  # acquired by a checkpoint's recomputation, released at its exit
    reported: set[int] = field(default_factory=set)  # id() of trainable parameters whose gradient came
    inputs_pending: int = 0  # watched uses whose inputs' gradient has not come yet
    watched: bool = False  # some use of it this pass is watched (hooks.InputWatch)
    unwatched: int = 0  # uses made without grad in forward, to watch when recomputed in backward

    @property
    def held(self) -> bool:
        """Gathered for its backward (it counts one reference)."""
        return self.backward in (UnitBackward.HELD, UnitBackward.FINISHED_HELD)

    @property
    def finished(self) -> bool:
        return self.backward in (UnitBackward.FINISHED_HELD, UnitBackward.FINISHED)

    def _move(self, transition: str, allowed: tuple[UnitBackward, ...], to: UnitBackward) -> None:
        if self.backward not in allowed:
            raise PassStateError(f"stage 3: unit '{self.unit.name}': {transition} in backward state "
                                 f"'{self.backward.value}' (internal error)")
        self.backward = to

    def hold(self) -> None:
        self._move("hold", (UnitBackward.WAITING,), UnitBackward.HELD)

    def finish(self) -> None:
        to = UnitBackward.FINISHED_HELD if self.backward is UnitBackward.HELD else UnitBackward.FINISHED
        self._move("finish", (UnitBackward.WAITING, UnitBackward.HELD), to)

    def let_go(self) -> None:
        self._move("let go", (UnitBackward.FINISHED_HELD,), UnitBackward.FINISHED)


def _wait_through_interrupts(wait: Callable[[], None]) -> None:
    """wait() for a background fetch into a unit's buffers, then raise a Ctrl-C that came while
    waiting: the prefetch thread is still copying into those buffers, and freeing them under it
    (the cleanup that follows an interrupted pass) crashed the process."""
    interrupted: KeyboardInterrupt | None = None
    while True:
        try:
            wait()
            break
        except KeyboardInterrupt as exc:  # the copy is bounded (one shard's read): wait it out
            interrupted = exc
        except BaseException as exc:  # the fetch failed: the user's Ctrl-C still comes first
            if interrupted is not None:
                raise interrupted from exc
            raise
    if interrupted is not None:
        raise interrupted
