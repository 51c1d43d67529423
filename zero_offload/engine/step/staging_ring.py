"""The staging ring: where the step puts non-addressable (nvme) optimizer state, and the thread that fills it.

One staging buffer cut into *regions*: one per shard, page-aligned, holding the shard's master,
m and v back to back exactly as its NVMe slot does (one read and one write per shard), and sized
to the shard (a small shard takes little room, so the whole pinned budget serves the read-ahead
whatever the shard sizes). Regions are placed at the ring's
head in the order of the *plan* -- the predicted stepping order, i.e. the previous step's gradient
arrival order -- wrapping to the start when a shard does not fit before the end.

A prefetch thread walks the plan: to place the next shard it evicts the regions in its way
(waiting for their write-backs) and submits the reads. The step worker waits only for the reads of
the shard it steps, never for another shard's write-back; so the drive stays busy with reads and
writes while the worker keeps up with backward.

Region states (the ring owns them and changes them under its lock; a move from a state that
does not allow it raises StagingStateError, a bug of ours):
  LOADING   placed by the prefetch thread, reads being submitted        -> PENDING (loaded)
  PENDING   reads submitted, not yet stepped in this plan: never evicted while the plan holds
                                                                        -> STEPPING (begin_step), CLEAN (unpin)
  STEPPING  handed out by acquire(): never evicted                      -> CLEAN (end_step)
  CLEAN     released (its write-back may still be in flight), or read and no longer planned: the
            newest copy of its shard; evictable, and a later acquire of that shard needs no read
                                                                        -> PENDING (pin), STEPPING (begin_step)
The ring's own state is one RingState (READY, PLACING, READ_FAILED, STEP_FAILED, FLUSHING, DEAD,
CLOSED; see there), moved the same way.
A shard is in at most one region and a region is reused only after its transfers finished, so no
read ever runs behind a pending write of the same shard.

A changed order costs reads, never a deadlock: acquire() of a shard that is not in the ring makes
it a *demand*, which the prefetch thread serves before the plan, evicting PENDING regions if needed.
"""
from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

from zero_offload.io.buffers import ALIGN_BYTES
from zero_offload.optim.adamw import ADAMW, PARTS
from zero_offload.optim.spec import OptimizerSpec
from zero_offload.store.base import Handle, Store

__all__ = ["ALIGN_ELEMENTS", "PARTS", "Region", "RegionState", "RingState", "StagingRing", "StagingStateError", "span"]
ALIGN_ELEMENTS = ALIGN_BYTES // 4  # fp32 elements: regions start on drive pages, the direct path's alignment


def aligned(numel: int) -> int:
    return -(-max(numel, 1) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def span(numel: int, spec: OptimizerSpec = ADAMW) -> int:
    """Ring elements a shard of `numel` takes: its state parts (the spec's), page-aligned."""
    return aligned(spec.state_numel(numel))


class StagingStateError(RuntimeError):
    """A region or the ring was asked to change state from a state that does not allow it: a bug
    of ours (never the drive's), refused before it can corrupt a shard."""


class RegionState(enum.Enum):
    LOADING = "loading"
    PENDING = "pending"
    STEPPING = "stepping"
    CLEAN = "clean"


# Each region transition: the states it may start from, and where it goes.
_REGION_MOVES: dict[str, tuple[tuple[RegionState, ...], RegionState]] = {
    "loaded": ((RegionState.LOADING,), RegionState.PENDING),
    "pin": ((RegionState.CLEAN,), RegionState.PENDING),
    "unpin": ((RegionState.PENDING,), RegionState.CLEAN),
    "begin_step": ((RegionState.PENDING, RegionState.CLEAN), RegionState.STEPPING),
    "end_step": ((RegionState.STEPPING,), RegionState.CLEAN),
}


class RingState(enum.Enum):
    """What the ring as a whole is doing; the prefetch thread places regions only when READY."""

    READY = "ready"  # placing regions as the plan or a demand asks
    PLACING = "placing"  # the prefetch thread holds a new region outside the lock (evicting, submitting reads)
    READ_FAILED = "read failed"  # a read ahead failed: nothing is placed; the next acquire raises it
    STEP_FAILED = "step failed"  # that error reached the step, or came with a failed write-back: flush raises it
    FLUSHING = "flushing"  # flush settles the regions it took out: nothing is placed over them meanwhile
    DEAD = "dead"  # the prefetch thread stopped (a bug): every acquire fails
    CLOSED = "closed"  # closed: the prefetch thread exits, every acquire fails


_ANY = tuple(RingState)
_FAILED = (RingState.READ_FAILED, RingState.STEP_FAILED)
# Each ring state: the states it may be entered from.
_RING_MOVES: dict[RingState, tuple[RingState, ...]] = {
    RingState.PLACING: (RingState.READY,),
    RingState.READ_FAILED: (RingState.PLACING,),
    RingState.STEP_FAILED: (RingState.PLACING, RingState.READ_FAILED),
    RingState.FLUSHING: (RingState.READY, RingState.FLUSHING, *_FAILED),  # FLUSHING: a flush while another settles
    RingState.READY: (RingState.PLACING, RingState.FLUSHING),
    RingState.DEAD: _ANY,
    RingState.CLOSED: _ANY,
}


@dataclass(eq=False)
class Region:
    """One shard's state parts (AdamW's master, m, v) in the ring: offsets, state and the transfers in flight."""

    key: str
    start: int
    numel: int
    length: int  # ring elements it takes: span(numel, spec)
    state: RegionState = RegionState.LOADING
    unused: bool = False  # read from the drive and not stepped since
    write_failed: bool = False  # a write-back failed: the drive's copy of the shard is older
    reads: list[Handle] = field(default_factory=list)
    writes: list[Handle] = field(default_factory=list)

    def overlaps(self, start: int, size: int) -> bool:
        return self.start < start + size and start < self.start + self.length

    def settle(self) -> None:
        """Wait for every transfer in flight, then re-raise the first error (a region is only
        reused once nothing of it is in flight, failed or not). Only an error marks a write
        failed: an interrupt (KeyboardInterrupt) leaves the transfers not yet waited for in the
        region, still to settle, and is raised at once."""
        first: Exception | None = None
        while self.reads or self.writes:
            is_write = not self.reads
            handles = self.writes if is_write else self.reads
            try:
                handles[0].wait()
            except Exception as exc:
                self.write_failed = self.write_failed or is_write
                first = first or exc
            del handles[0]  # waited for (an interrupt skips this: the handle stays to wait again)
        if first is not None:
            raise first

    # ---- transitions ----
    def _move(self, event: str) -> None:
        """Take transition `event`, or raise StagingStateError if the region's state does not allow it."""
        sources, target = _REGION_MOVES[event]
        if self.state not in sources:
            allowed = " or ".join(s.name for s in sources)
            raise StagingStateError(f"staging region of shard {self.key!r}: {event} needs state {allowed}, "
                                    f"it is {self.state.name}")
        self.state = target

    def loaded(self, reads: list[Handle]) -> None:
        """LOADING -> PENDING: its reads are submitted."""
        self._move("loaded")
        self.reads, self.unused = reads, True

    def pin(self) -> None:
        """CLEAN -> PENDING: a region left from an earlier step is planned again."""
        self._move("pin")

    def unpin(self) -> None:
        """PENDING -> CLEAN: the plan changed and no longer counts on this region."""
        self._move("unpin")

    def begin_step(self) -> None:
        """PENDING or CLEAN -> STEPPING: acquire() hands it to the step."""
        self._move("begin_step")
        self.unused = False

    def end_step(self, writes: list[Handle]) -> None:
        """STEPPING -> CLEAN: released, its write-back in flight."""
        self._move("end_step")
        self.writes = writes


class StagingRing:
    """Regions of one staging buffer, filled ahead of the step by a prefetch thread."""

    def __init__(self, store: Store, capacity: int, spec: OptimizerSpec = ADAMW) -> None:
        self.store = store
        self.capacity = capacity  # fp32 elements
        self.spec = spec  # the optimizer's state parts: what a region holds
        self.buffer = store.staging_buffer(capacity, torch.float32)
        self._regions: list[Region] = []  # placement order, oldest first
        self._index: dict[str, Region] = {}
        self._head = 0
        self._plan: deque[tuple[str, int]] = deque()
        self._demand: tuple[str, int] | None = None
        self._planned: set[str] = set()
        self._stepped: set[str] = set()  # acquired since the plan was set: not pinned again
        self._state = RingState.READY
        self._error: BaseException | None = None  # READ_FAILED / STEP_FAILED: the failure; flush() clears it
        self._why_dead = ""  # DEAD: why the prefetch thread stopped
        self._flush_depth = 0  # FLUSHING: flushes in progress (the last one out makes the ring READY)
        self._stale: dict[str, str] = {}  # key -> why the drive's copy is older (until rewritten)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="zero-offload-read-ahead", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def ring_state(self) -> RingState:
        return self._state

    @property
    def _busy(self) -> bool:
        """The prefetch thread holds a region outside the lock (read by tests)."""
        return self._state is RingState.PLACING

    def _move(self, to: RingState) -> None:
        """Under the lock: enter `to`, or raise StagingStateError if the ring's state does not allow it."""
        if self._state not in _RING_MOVES[to]:
            allowed = " or ".join(s.name for s in _RING_MOVES[to])
            raise StagingStateError(f"staging ring: cannot go to {to.name} from {self._state.name} "
                                    f"(only from {allowed})")
        self._state = to

    def state(self, region: Region) -> torch.Tensor:
        """The region's state parts back to back: what its store key holds."""
        return self.buffer[region.start:region.start + self.spec.state_numel(region.numel)]

    def views(self, region: Region) -> tuple[torch.Tensor, ...]:
        return self.state(region).view(len(self.spec.parts), region.numel).unbind(0)

    # ---- the step worker's side ----
    def plan(self, shards: list[tuple[str, int]]) -> None:
        """Read these shards ahead, in this order, from now on (replacing any plan in progress)."""
        if any(span(n, self.spec) > self.capacity for _, n in shards):
            raise ValueError("StagingRing.plan: a shard is larger than the ring")
        with self._cond:
            self._plan, self._stepped = deque(shards), set()
            self._planned = {k for k, _ in shards}
            for r in self._regions:
                if r.state is RegionState.PENDING and r.key not in self._planned:
                    r.unpin()
            self._cond.notify_all()

    def acquire(self, key: str, numel: int) -> Region:
        """The region holding `key`, read and ready to step (waits for the prefetch thread).
        A failed transfer of any shard fails the next acquire: the step cannot complete."""
        if span(numel, self.spec) > self.capacity:
            raise ValueError(f"StagingRing.acquire({key!r}): {numel} elements do not fit the ring")
        with self._cond:
            while True:
                self._raise_if_unusable(key)
                r = self._index.get(key)
                if r is not None and r.state in (RegionState.PENDING, RegionState.CLEAN):
                    break
                if r is None and self._demand != (key, numel):
                    self._demand = (key, numel)
                    self._cond.notify_all()
                self._cond.wait()
            r.begin_step()
            self._stepped.add(key)
        try:
            r.settle()  # its reads, or a write-back from an earlier step still in flight
        except BaseException:
            with self._cond:
                self._note_failure(r)
            raise
        return r

    def check(self, key: str) -> None:
        """Raise if the drive's copy of `key` is older than its last update (a write-back failed)."""
        with self._cond:
            if key in self._stale:
                raise RuntimeError(self._stale[key])

    def rewritten(self, key: str) -> None:
        """`key` was written to the store anew (e.g. from a checkpoint): its copy is current."""
        with self._cond:
            self._stale.pop(key, None)

    def _raise_if_unusable(self, key: str) -> None:
        if self._state is RingState.CLOSED:
            raise RuntimeError(f"the staging ring is closed: shard {key!r} cannot be staged")
        if self._state in _FAILED:
            if self._state is RingState.READ_FAILED:
                self._move(RingState.STEP_FAILED)  # the step saw it: flush() raises it too
            raise self._error
        if key in self._stale:
            raise RuntimeError(self._stale[key])
        if self._state is RingState.DEAD:
            raise RuntimeError(self._why_dead)

    def _note_failure(self, region: Region) -> None:
        """Under the lock, after a region's transfer failed: a failed write-back leaves the drive
        with an older copy, which no later step may read as if it were current."""
        if region.write_failed and region.key not in self._stale:
            self._stale[region.key] = (f"the write-back of optimizer shard {region.key!r} to the drive failed; "
                                       "the drive holds an older copy of its state: load a checkpoint to go on")

    def release(self, region: Region) -> None:
        """Start writing the stepped region back; the ring reuses it once the writes are done."""
        writes: list[Handle] = []
        try:
            writes.append(self.store.write(region.key, self.state(region)))
        except BaseException:
            region.write_failed = True
            raise
        finally:
            with self._cond:
                region.end_step(writes)
                if region.write_failed:
                    self._note_failure(region)
                self._cond.notify_all()

    def flush(self, *, after_error: bool = False) -> int:
        """Drop the plan, finish every transfer and forget every region (the store may change
        behind the ring). Returns the bytes read into regions still held and never stepped:
        read-ahead for a step that has not run, which benchmarks leave out of a step's traffic.
        After a failure a region may hold a half-updated shard: forgetting it keeps the next step
        reading the store's copy. A failed write-back stays reported (check(), acquire()) until
        the shard is rewritten. Raised (unless `after_error`): a failed write-back, or the error
        an acquire raised; not a failed read ahead that no step used (the shard's next acquire
        reads it again and reports its own error). An interrupt leaves the regions whose
        transfers are still in flight in the ring, to be settled by whoever reuses them."""
        with self._cond:
            self._plan, self._demand, self._stepped, self._planned = deque(), None, set(), set()
            while self._state is RingState.PLACING:
                self._cond.wait()
            regions, self._regions, self._index, self._head = self._regions, [], {}, 0
            err = self._error if self._state is RingState.STEP_FAILED else None
            self._begin_flush()
        settled = False
        try:
            err = _settle_all(regions, err)
            settled = True
        finally:
            with self._cond:
                for r in regions:
                    self._note_failure(r)
                if not settled:
                    self._keep_unsettled(regions)
                self._end_flush()
                self._cond.notify_all()
        if err is not None and not after_error:
            raise err
        return sum(self.spec.state_bytes(r.numel) for r in regions if r.unused)

    def _begin_flush(self) -> None:
        """Under the lock: any failure is taken by this flush, and until the regions it took out
        settle, their memory may still be written back from or read into, so nothing is placed
        (FLUSHING). A dead or closed ring stays so: no thread places anything there."""
        self._error = None
        if self._state not in (RingState.DEAD, RingState.CLOSED):
            self._move(RingState.FLUSHING)
            self._flush_depth += 1

    def _end_flush(self) -> None:
        """Under the lock: the last flush in progress has settled its regions (READY again)."""
        if self._state is RingState.FLUSHING:
            self._flush_depth -= 1
            if self._flush_depth == 0:
                self._move(RingState.READY)

    def _keep_unsettled(self, regions: list[Region]) -> None:
        """Under the lock, after an interrupted flush: the regions with transfers still in flight
        go back into the ring as CLEAN (the newest copy of their shard once settled), so their
        memory is not placed over before they settle (an eviction or acquire settles them)."""
        for r in regions:
            if r.reads or r.writes:
                if r.state is RegionState.PENDING:
                    r.unpin()
                self._regions.append(r)
                self._index.setdefault(r.key, r)

    def close(self, *, after_error: bool = False) -> None:
        try:
            self.flush(after_error=after_error)
        finally:
            with self._cond:
                self._move(RingState.CLOSED)
                self._cond.notify_all()
            self._thread.join()

    # ---- the prefetch thread ----
    def _run(self) -> None:
        try:
            while self._serve_one():
                pass
        except BaseException as exc:  # a bug, not an I/O error: never leave acquire() waiting
            with self._cond:
                self._why_dead = f"the staging ring's prefetch thread stopped: {exc!r}"
                self._move(RingState.DEAD)
                self._cond.notify_all()

    def _serve_one(self) -> bool:
        """Place the next planned (or demanded) shard and start its read; False when closing."""
        with self._cond:
            job = self._next_job()
            if job is None:
                return False
            region, victims, demanded = job
        reads: list[Handle] = []
        try:
            self._settle_victims(victims)
            reads.append(self.store.read(region.key, self.state(region)))
        except BaseException as exc:  # reported to the step by acquire()
            _settle_quietly(reads)  # nothing may land in the region once it is forgotten
            with self._cond:
                self._forget(region)
                self._error = exc  # a victim's failed write-back is the step's: flush() raises it
                self._move(RingState.STEP_FAILED if any(v.write_failed for v in victims) else RingState.READ_FAILED)
                self._cond.notify_all()
            return True
        with self._cond:
            region.loaded(reads)
            if not demanded and region.key not in self._planned:  # the plan changed meanwhile
                region.unpin()
            self._move(RingState.READY)
            self._cond.notify_all()
        return True

    def _settle_victims(self, victims: list[Region]) -> None:
        """Wait for every evicted region's transfers (all of them, even after one failed)."""
        first: BaseException | None = None
        for v in victims:
            try:
                v.settle()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            with self._cond:
                for v in victims:
                    self._note_failure(v)
            raise first

    def _next_job(self) -> tuple[Region, list[Region], bool] | None:
        """Under the lock: wait for a shard to place and room for it; None when closing."""
        while self._state is not RingState.CLOSED:
            entry = self._demand or (self._plan[0] if self._plan else None)
            if entry is None or self._state is not RingState.READY:
                self._cond.wait()
                continue
            key, numel = entry
            hit, demanded = self._index.get(key), entry is self._demand
            if not demanded and key in self._stepped:  # demanded and stepped already: not again
                self._consume(entry)
                continue
            if hit is not None:
                self._consume(entry)
                if not demanded and hit.state is RegionState.CLEAN:
                    hit.pin()
                continue
            placed = self._place(numel, evict_pending=demanded)
            if placed is None:
                self._cond.wait()
                continue
            start, victims = placed
            self._consume(entry)
            region = Region(key, start, numel, span(numel, self.spec))
            self._regions.append(region)
            self._index[key] = region
            self._head = start + region.length
            self._move(RingState.PLACING)
            return region, victims, demanded
        return None

    def _consume(self, entry: tuple[str, int]) -> None:
        if entry is self._demand:
            self._demand = None
        else:
            self._plan.popleft()

    def _place(self, numel: int, *, evict_pending: bool) -> tuple[int, list[Region]] | None:
        """Where the next region goes and the regions it evicts; None if one of them is in use."""
        size = span(numel, self.spec)
        start = self._head if self._head + size <= self.capacity else 0
        victims = [r for r in self._regions if r.overlaps(start, size)]
        movable = (RegionState.CLEAN, RegionState.PENDING) if evict_pending else (RegionState.CLEAN,)
        if any(r.state not in movable for r in victims):
            return None
        for r in victims:
            self._forget(r)
        return start, victims

    def _forget(self, region: Region) -> None:
        self._regions.remove(region)
        if self._index.get(region.key) is region:
            del self._index[region.key]


def _settle_all(regions: list[Region], err: BaseException | None) -> BaseException | None:
    """Settle every region (all of them, even after one failed); the first of `err` and the
    regions' failed write-backs. A failed read here is a read ahead no step used: not an error."""
    for r in regions:
        try:
            r.settle()
        except Exception as exc:
            if r.write_failed:
                err = err or exc
    return err


def _settle_quietly(handles: list[Handle]) -> None:
    for h in handles:
        try:
            h.wait()
        except Exception:  # noqa: BLE001 -- the first error is already being reported
            pass
