"""The traced schedule and the prefetcher: units arrive before they are needed, inside a hard budget.

Here "prefetch" is a unit's gather ahead of its use (thread `zo-prefetch`); the optimizer's
read-ahead of its state into the staging ring (engine/step/staging_ring.py) is another thing.

Schedule. A pass (one forward and its backward) uses units in some order. The first pass records
it; later passes compare each use against the record. While they match, the prefetcher starts the
local fetch (tier -> staging -> device) of the next `depth` units on a background thread, so it
overlaps the compute of the current one. At the first mismatch (data-dependent control flow) the
rest of the pass falls back to on-demand fetches and unused prefetches are dropped. At the end of
the pass every rank checks, with `comm.all_agree`, that all ranks used the same units in the same
order, and the pass's order becomes the record.

Why only the local fetch is prefetched: the all-gather is collective, so it is issued on the main
thread exactly when a unit is used, in execution order. Then ranks never disagree about which
collective comes next, whatever the prefetcher guessed, so a wrong guess costs a wasted read,
never a hang.

Budget. `LiveBudget` counts the bytes of every unit that is fetching or gathered (the full
flat buffers), read from the units' states. A prefetch starts only if it fits. An on-demand fetch that does not fit first drops
prefetched units; if it still does not fit, it is an error naming the units that are held, so the
budget is never exceeded, not even briefly.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import torch

from zero_offload import comm
from zero_offload.engine.stage3.unit import Unit, UnitState
from zero_offload.interrupts import held_interrupts


# A unit under 1/SMALL_UNIT of another's bytes takes no place in the window that decides whether
# that other is kept (Prefetcher.release).
SMALL_UNIT = 16

_REDUCE_HINT = (", and a parameter must get a gradient on every rank or on none (multiply an unused one by 0 "
                "into the loss)")


def check_same_unit(unit: Unit, purpose: str = "gather", siblings: Mapping[int, tuple[str, str]] | None = None) -> None:
    """Every rank must gather (or reduce) the same unit now; a tiny all-reduce checks it before the
    collective, so ranks whose control flow diverged fail at once with a message instead of hanging
    in mismatched collectives, or pairing them (all of them are in this same all-reduce, whatever
    unit each one wanted). The code tells a reduction from a gather, and a gather with grad from
    one without: an evaluation forward on rank 0 alone would otherwise pair its gathers with the
    other ranks' training gathers of the same units and hang later, in the next mismatch.
    `siblings` (unit_policy.Plan.siblings) tells two items of one list apart: experts that a
    router sent each rank's tokens to, which the message says how to keep in one unit."""
    if comm.world_size() == 1:
        return
    kind = 1 if purpose == "reduce" else (0 if torch.is_grad_enabled() else 2)
    code = 4 * unit.index + kind
    ids = torch.tensor([code, -code], dtype=torch.int64, device=unit.device)
    comm.all_reduce_(ids, "max")
    low, high = -int(ids[1]), int(ids[0])
    if low != high:
        raise RuntimeError(f"stage 3: ranks {purpose} different units next (rank {comm.rank()}: {purpose} "
                           f"'{unit.name}'{_KIND_NOTE[kind]}); every rank must run the same modules in the same "
                           f"order{_hint(low % 4, high % 4) or _routing_hint(low // 4, high // 4, siblings or {})}")


_KIND_NOTE = {0: " with grad", 1: "", 2: " without grad"}


def _hint(*kinds: int) -> str:
    """What most likely diverged: a unit reduced at another time (a parameter unused on some
    ranks) or a forward without grad on some ranks only (an evaluation on rank 0)."""
    if 1 in kinds:
        return _REDUCE_HINT
    if 0 in kinds and 2 in kinds:
        return ", with grad or without (an evaluation forward must run on every rank, or on none)"
    return ""


def _routing_hint(a: int, b: int, siblings: Mapping[int, tuple[str, str]]) -> str:
    """Two items of lists of one class each (per-expert units: a router chose them by token), or
    any other pair."""
    if a in siblings and b in siblings:
        lists = " and ".join(f"'{w}'" for w in sorted({siblings[a][0], siblings[b][0]}))
        owners = sorted({siblings[a][1], siblings[b][1]})
        return (f"; both are items of {lists}: if a router picks them by token (experts), make the module "
                f"holding them one unit: stage3.leaf_modules={owners}")
    return ("; experts that a router picks by token must be one unit: name the class of the module holding "
            "them in stage3.leaf_modules")


class BudgetExceeded(RuntimeError):
    """A unit needed now does not fit the live budget beside the units held."""


class LiveBudget:
    """The bytes of gathered (and fetching) units against a hard limit. `live` is read from
    the units' own states (every unit not resident and not SHARDED), not counted apart: a
    count kept beside the state machine was split by a Ctrl-C between the two (a unit SHARDED
    again whose bytes stayed taken, or the other way round), and every later pass failed with
    BudgetExceeded or "released more than it took". `take` checks that a unit about to leave
    SHARDED fits; a unit back in SHARDED gives its bytes back by being there."""

    def __init__(self, limit: int, units: Sequence[Unit] = ()) -> None:
        self.limit = limit
        self.units = list(units)
        self.peak = 0

    @property
    def live(self) -> int:
        return sum(u.nbytes for u in self.units if not u.resident and u.state is not UnitState.SHARDED)

    def fits(self, nbytes: int) -> bool:
        return self.live + nbytes <= self.limit

    def take(self, nbytes: int) -> None:
        """A unit of `nbytes` is about to leave SHARDED (its state makes it count)."""
        live = self.live
        if live + nbytes > self.limit:
            raise AssertionError(f"live budget exceeded: {live} + {nbytes} > {self.limit}")
        self.peak = max(self.peak, live + nbytes)


class Schedule:
    """The recorded order of unit uses and this pass's progress against it."""

    def __init__(self) -> None:
        self.recorded: list[int] | None = None
        self.current: list[int] = []
        self.trusted = False
        self.rerecorded = 0  # passes whose order differed from the record (statistics, tests)

    def begin_pass(self) -> None:
        self.current = []
        self.trusted = self.recorded is not None

    def note_use(self, index: int) -> bool:
        """Record a use; True while the pass still follows the recorded order."""
        pos = len(self.current)
        self.current.append(index)
        if self.trusted and (pos >= len(self.recorded) or self.recorded[pos] != index):
            self.trusted = False
        return self.trusted

    def upcoming(self, depth: int, gathered: Callable[[int], bool] = lambda index: False) -> list[int]:
        """The recorded uses after the current position, up to the one that brings the count of
        distinct units still to fetch to `depth` (empty when not trusted). Units `gathered` now
        cost nothing to keep, so they do not use up the window: without that, a unit held
        across the forward (a tied embedding read by the head) hides the last block, which is
        then released at the end of forward and fetched again first thing in backward."""
        if not self.trusted:
            return []
        out: list[int] = []
        to_fetch: set[int] = set()
        for index in self.recorded[len(self.current):]:
            if len(to_fetch) >= depth:
                break
            out.append(index)
            if not gathered(index):
                to_fetch.add(index)
        return out

    def end_pass(self, found: object = ()) -> None:
        """All ranks must have used the same units in the same order (and found the same
        parameters read outside their unit, `found`); the order becomes the record."""
        if not comm.all_agree((self.current, found)):
            raise RuntimeError(f"stage 3: ranks used different units this pass (rank {comm.rank()} used "
                               f"{len(self.current)} units); every rank must run the same modules in the same order")
        if self.recorded is not None and self.current != self.recorded:
            self.rerecorded += 1
        self.recorded = list(self.current)
        self.trusted = False

    def forget(self) -> None:
        """No record: the next pass records (the runtime knows its order will differ)."""
        self.recorded = None
        self.trusted = False


class Prefetcher:
    """Brings units to GATHERED when used (on demand or from a prefetch) and releases them."""

    def __init__(self, units: Sequence[Unit], budget: int, depth: int,
                 siblings: Mapping[int, tuple[str, str]] | None = None) -> None:
        # prefetched: units fetched ahead (FETCHING) or kept after a use (GATHERED), not yet used again
        self.units = list(units)
        self.budget = LiveBudget(budget, self.units)
        self.depth = depth
        self.schedule = Schedule()
        self.siblings = dict(siblings or {})  # unit_policy.Plan.siblings, for check_same_unit's message
        self.prefetched: list[Unit] = []
        self.apart: set[int] = set()  # units engine.gathered holds: a pass's use neither fetches nor releases them
        self.on_demand = 0  # fetches the step waited for in full (statistics)
        self.fetches = [0] * len(self.units)  # every fetch, on demand or ahead, per unit (statistics)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zo-prefetch")

    def begin_pass(self) -> None:
        self.schedule.begin_pass()

    def use(self, unit: Unit) -> None:
        """`unit` is needed now: make it GATHERED, then start prefetching what comes next. One
        transaction (interrupts held): a Ctrl-C inside it left a unit half fetched or half
        released, its parameters empty in the next pass (torch's "weight of shape [0]")."""
        with held_interrupts():
            self._use(unit)

    def _use(self, unit: Unit) -> None:
        check_same_unit(unit, siblings=self.siblings)
        following = self.schedule.note_use(unit.index)
        if unit.index in self.apart:  # gathered by engine.gathered for the whole block: nothing to fetch
            return
        if not following:
            self._drop_prefetched(keep=unit)
        if unit in self.prefetched:
            self.prefetched.remove(unit)
        elif unit.state is UnitState.SHARDED:
            self._fetch_now(unit)
        if following:
            self._prefetch_ahead()
        if unit.state is UnitState.FETCHING:
            unit.finish_gather()

    def release(self, unit: Unit) -> None:
        """Done with `unit` for now; it stays gathered if the record says it is used again next.
        Units far smaller than it do not use up the window here (a final norm of 4 KiB between the
        last blocks and the backward would push the last block but one out): keeping costs budget
        only, which a fetch that needs it takes back. One transaction, as use() is."""
        with held_interrupts():
            self._release(unit)

    def _release(self, unit: Unit) -> None:
        if unit.index in self.apart:  # engine.gathered's block lets it go when it ends
            return
        def free(i: int) -> bool:
            return i != unit.index and (self._held(i) or self.units[i].nbytes * SMALL_UNIT < unit.nbytes)
        if unit.index in self.schedule.upcoming(self.depth, free):
            self.prefetched.insert(0, unit)
            return
        unit.release()

    def end_pass(self, found: object = ()) -> None:
        self._drop_prefetched()
        self.schedule.end_pass(found)

    def release_all(self) -> None:
        """Every unit back to SHARDED, its bytes back to the budget, without recording the pass:
        after a pass that stopped part way (its forward or backward raised, so the post-hooks
        that release never ran) and before the compute-copy shards are rewritten (a checkpoint
        load: a unit gathered or read ahead would keep the old values)."""
        first: BaseException | None = None
        self.schedule.trusted = False
        held = [u for u in self.units if not u.resident and u.state is not UnitState.SHARDED and u.index not in self.apart]
        self.prefetched = []
        for u in held:  # every unit, even after one's read ahead failed; the first error after
            try:
                self.let_go(u)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def warm_start(self) -> None:
        """Start fetching the next pass's first units now (their shards are final for that pass:
        called after the step, or after a backward that does not end an accumulation cycle)."""
        self.schedule.begin_pass()
        self._prefetch_ahead()

    def _held(self, index: int) -> bool:
        """Whether a unit is gathered for a use in progress, so keeping it costs no fetch. Units
        fetched ahead or kept (`prefetched`) still count: `depth` bounds how many of those there are."""
        u = self.units[index]
        return u.resident or (u.state is UnitState.GATHERED and u not in self.prefetched)

    def _fetch_now(self, unit: Unit) -> None:
        for victim in reversed(list(self.prefetched)):  # the furthest-ahead prefetch goes first
            if self.budget.fits(unit.nbytes):
                break
            self._abandon(victim)
        if not self.budget.fits(unit.nbytes):
            held = [u for u in self.units if u.state is not UnitState.SHARDED and not u.resident]
            raise BudgetExceeded(
                f"stage3.live_budget_bytes = {self.budget.limit} is too small: unit '{unit.name}' needs "
                f"{unit.nbytes} bytes while {self.budget.live} bytes are held by units "
                f"{[u.name for u in held]}; raise the budget or use smaller units")
        self.budget.take(unit.nbytes)
        self.on_demand += 1
        self.fetches[unit.index] += 1
        unit.fetch()

    def _prefetch_ahead(self) -> None:
        for index in self.schedule.upcoming(self.depth, self._held):
            u = self.units[index]
            if u.resident or u.state is not UnitState.SHARDED:
                continue
            if not self.budget.fits(u.nbytes):
                break  # nearest first: never skip ahead past a unit that does not fit yet
            self.budget.take(u.nbytes)
            self.fetches[u.index] += 1
            u.begin_fetch()
            u.set_pending(self._pool.submit(u.fetch_local).result)
            self.prefetched.append(u)

    def gather_apart(self, unit: Unit) -> None:
        """`unit` GATHERED now outside any pass (engine.gathered; the caller made room for it):
        its bytes count in the budget, the schedule is not told. Every rank gathers the same
        units (a collective each); after a failure the unit is SHARDED, its bytes back."""
        check_same_unit(unit)
        self.budget.take(unit.nbytes)
        with held_interrupts():  # gathered and owned by the block together, or neither
            try:
                unit.gather()
            except BaseException:
                self._let_go(unit)
                raise
            self.apart.add(unit.index)

    def let_go_apart(self, unit: Unit) -> None:
        """The end of engine.gathered's block: a unit it gathered goes back to SHARDED."""
        with held_interrupts():
            self.apart.discard(unit.index)
            self._let_go(unit)

    def _abandon(self, unit: Unit) -> None:
        self.prefetched.remove(unit)
        self.let_go(unit)

    def let_go(self, unit: Unit) -> None:
        """GATHERED or FETCHING -> SHARDED and its bytes back, even when a read ahead failed
        (the unit is SHARDED then too: its error is raised after the bookkeeping), or when a
        gather failed before the unit left SHARDED."""
        with held_interrupts():
            self._let_go(unit)

    def _let_go(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERED:
            unit.release()
        elif unit.state is UnitState.FETCHING:
            unit.abandon()

    def _drop_prefetched(self, keep: Unit | None = None) -> None:
        for u in list(self.prefetched):
            if u is not keep:
                self._abandon(u)

    def close(self) -> None:
        self._drop_prefetched()
        self._pool.shutdown(wait=True)
