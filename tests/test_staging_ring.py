"""The staging ring (engine/step/staging_ring.py): read-ahead into regions sized to each shard, a prefetch
thread that never overwrites a region in use, any stepping order served, failures reported."""
from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine.step.staging_ring import ALIGN_ELEMENTS as ALIGN, PARTS, RegionState, StagingRing, span
from zero_offload.store import make_store
from zero_offload.store.base import Handle, Store


def _store(tmp_path: Path) -> Store:
    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),))
    return make_store("nvme", "optimizer", cfg, device=torch.device("cpu"), rank=0, capacity_bytes=8 << 20)


def _fill(store: Store, sizes: dict[str, int]) -> dict[tuple[str, str], torch.Tensor]:
    """Every shard's parts (back to back under its key) written with distinct values; returns
    what the store holds."""
    values = {}
    for i, (key, n) in enumerate(sizes.items()):
        store.allocate(key, 3 * n, torch.float32)
        for j, part in enumerate(PARTS):
            values[key, part] = torch.arange(n, dtype=torch.float32) + 1000 * i + 100 * j
        store.write(key, torch.cat([values[key, p] for p in PARTS])).wait()
    return values


def _stored(store: Store, key: str, part: str, n: int) -> torch.Tensor:
    return store.read(key, torch.empty(3 * n)).wait()[PARTS.index(part) * n:(PARTS.index(part) + 1) * n]


def test_a_region_being_stepped_is_never_overwritten(tmp_path: Path) -> None:
    """The smallest ring (three shards) with the plan running far ahead: while 'a' is held,
    the prefetch thread fills every other region but must wait for 'a' to be released."""
    store = _store(tmp_path)
    sizes = {k: 3000 for k in "abcdef"}
    values = _fill(store, sizes)
    ring = StagingRing(store, 3 * span(3000))
    ring.plan(list(sizes.items()))
    region = ring.acquire("a", 3000)
    master, m, v = ring.views(region)
    ring.acquire("b", 3000)  # ... and 'b' too: only one region is left to read into
    for _ in range(50):  # give the prefetch thread every chance to go wrong
        threading.Event().wait(0.002)
    assert torch.equal(master, values["a", "master"]) and torch.equal(v, values["a", "v"])
    assert region.state is RegionState.STEPPING
    ring.flush()
    store.close()


def test_any_order_of_acquires_reads_the_newest_copy(tmp_path: Path) -> None:
    """Shards of mixed sizes stepped in a shuffled order each step (the plan is the previous
    step's order, so most predictions are wrong): every acquire sees the shard's latest update,
    and the store ends with every update written."""
    store = _store(tmp_path)
    rng = random.Random(0)
    sizes = {f"s{i}": rng.choice([10, 700, 1500, 5000]) for i in range(12)}
    expected = _fill(store, sizes)
    ring = StagingRing(store, 3 * span(5000) + ALIGN)
    order = list(sizes)
    for _ in range(6):
        ring.plan([(k, sizes[k]) for k in order])
        order = order[:]
        rng.shuffle(order)
        for key in order:
            region = ring.acquire(key, sizes[key])
            for part, view in zip(PARTS, ring.views(region)):
                assert torch.equal(view, expected[key, part]), (key, part)
                view.add_(1.0)  # the "update"
                expected[key, part] = view.clone()
            ring.release(region)
    ring.flush()
    for (key, part), value in expected.items():
        assert torch.equal(_stored(store, key, part, sizes[key]), value), (key, part)
    ring.close()
    store.close()


def test_small_shards_take_little_room(tmp_path: Path) -> None:
    """A ring the size of three large shards reads ahead many more small ones: regions are
    sized to the shard, not to the largest."""
    store = _store(tmp_path)
    sizes = {"big": 20 * ALIGN, **{f"small{i}": 100 for i in range(30)}}
    _fill(store, sizes)
    ring = StagingRing(store, 3 * span(20 * ALIGN))
    ring.plan(list(sizes.items()))
    ring.release(ring.acquire("big", sizes["big"]))
    _wait_for_plan(ring)
    held = [k for k, r in ring._index.items() if r.state is RegionState.PENDING]  # noqa: SLF001
    assert held == [f"small{i}" for i in range(30)]  # every one read ahead at once
    assert ring.flush() == 12 * 100 * 30  # read ahead and never stepped
    ring.close()
    store.close()


def _wait_for_plan(ring: StagingRing) -> None:
    """Until the prefetch thread has placed every planned shard."""
    for _ in range(5000):
        with ring._cond:  # noqa: SLF001
            if not ring._plan and not ring._busy:  # noqa: SLF001
                return
        threading.Event().wait(0.001)
    raise AssertionError("the prefetch thread did not work through its plan")


def test_flush_reports_read_ahead_and_next_plan_reads_again(tmp_path: Path) -> None:
    store = _store(tmp_path)
    sizes = {"a": 2048, "b": 2048}
    _fill(store, sizes)
    ring = StagingRing(store, 3 * span(2048))
    ring.plan(list(sizes.items()))
    ring.release(ring.acquire("a", 2048))
    ring.acquire("b", 2048)  # wait until 'b' is in; then step it
    assert ring.flush() == 0  # both were stepped: nothing read in vain
    ring.plan(list(sizes.items()))
    _wait_for_plan(ring)
    assert ring.flush() == 12 * 4096
    ring.close()
    store.close()


def test_a_failed_read_surfaces_at_acquire_and_flush_resets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    sizes = {"a": 1024, "b": 1024}
    values = _fill(store, sizes)
    ring = StagingRing(store, 3 * span(1024))
    real = store.read

    def failing(key: str, dst: torch.Tensor) -> object:
        if key == "b":
            raise OSError(5, "simulated read failure")
        return real(key, dst)
    monkeypatch.setattr(store, "read", failing)
    ring.plan([("b", 1024)])
    with pytest.raises(OSError, match="simulated read failure"):
        ring.acquire("b", 1024)
    with pytest.raises(OSError, match="simulated read failure"):  # until flushed, every acquire
        ring.acquire("a", 1024)
    with pytest.raises(OSError, match="simulated read failure"):
        ring.flush()
    monkeypatch.setattr(store, "read", real)
    ring.plan(list(sizes.items()))
    for key in sizes:
        region = ring.acquire(key, 1024)
        assert torch.equal(ring.views(region)[2], values[key, "v"])
        ring.release(region)
    ring.close()
    store.close()


def test_a_shard_larger_than_the_ring_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    ring = StagingRing(store, span(2 * ALIGN))
    with pytest.raises(ValueError, match="larger than the ring"):
        ring.plan([("x", 3 * ALIGN)])
    with pytest.raises(ValueError, match="do not fit the ring"):
        ring.acquire("x", 3 * ALIGN)
    ring.close()
    store.close()


class LazyStore(Store):
    """A store whose transfers happen only when waited for, after a random pause: a transfer is
    "in flight" from submission to wait(), which is what lets a test catch the ring reusing
    memory under a transfer, or reading a shard while its write-back is still pending."""

    tier = "nvme"

    def __init__(self, seed: int = 0, fail: Callable[[str, str], bool] = lambda op, key: False) -> None:
        self.data: dict[str, torch.Tensor] = {}
        self.fail = fail
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.in_flight: list[tuple[str, str, int, int, object]] = []
        self.violations: list[str] = []
        self.reads = 0

    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        self.data[key] = torch.zeros(numel)

    def staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def _begin(self, op: str, key: str, t: torch.Tensor) -> object:
        lo, hi, token = t.data_ptr(), t.data_ptr() + 4 * t.numel(), object()
        with self.lock:
            for op2, key2, lo2, hi2, _ in self.in_flight:
                if lo < hi2 and lo2 < hi:
                    self.violations.append(f"{op} of {key} overlaps the {op2} of {key2} in flight")
                if op == "read" and op2 == "write" and key2 == key:
                    self.violations.append(f"read of {key} behind its pending write")
            self.in_flight.append((op, key, lo, hi, token))
        return token

    def _finish(self, op: str, key: str, token: object, move: Callable[[], None]) -> None:
        threading.Event().wait(0.002 * self.rng.random())
        move()
        with self.lock:
            self.in_flight = [e for e in self.in_flight if e[4] is not token]
        if self.fail(op, key):
            raise OSError(5, f"simulated {op} failure of {key}")

    def write(self, key: str, src: torch.Tensor) -> Handle:
        token, snapshot = self._begin("write", key, src), src.clone()

        def done() -> None:
            if not torch.equal(snapshot, src):
                self.violations.append(f"the source of {key}'s write changed while in flight")
            self._finish("write", key, token, lambda: self.data[key].copy_(snapshot))
        return Handle(done, src)

    def read(self, key: str, dst: torch.Tensor) -> Handle:
        token = self._begin("read", key, dst)
        self.reads += 1
        return Handle(lambda: self._finish("read", key, token, lambda: dst.copy_(self.data[key])), dst)

    def free(self, key: str) -> None:
        self.data.pop(key, None)

    def keys(self) -> list[str]:
        return list(self.data)

    def bytes_retained(self) -> int:
        return 0

    def peak_bytes(self) -> int:
        return 0


def test_shuffled_orders_with_slow_transfers_never_race(tmp_path: Path) -> None:
    """Forty steps of mixed sizes in a changing order, every transfer slow and completed late:
    no memory is reused under a transfer, no read runs behind its shard's write-back, and every
    update reaches the store."""
    store = LazyStore(seed=1)
    rng = random.Random(2)
    sizes = {f"s{i}": rng.choice([10, 700, 1500, 3000]) for i in range(10)}
    expected = _fill(store, sizes)
    ring = StagingRing(store, 3 * span(3000) + 2 * ALIGN)
    order = list(sizes)
    for step in range(40):
        ring.plan([(k, sizes[k]) for k in order])
        if step % 3 == 0:
            order = order[:]
            rng.shuffle(order)
        for key in order:
            region = ring.acquire(key, sizes[key])
            for part, view in zip(PARTS, ring.views(region)):
                assert torch.equal(view, expected[key, part]), (step, key, part)
                view.add_(1.0)
                expected[key, part] = view.clone()
            ring.release(region)
    ring.close()
    assert store.violations == []
    for (key, part), value in expected.items():
        assert torch.equal(_stored(store, key, part, sizes[key]), value), (key, part)


def test_a_failed_write_back_is_reported_until_the_shard_is_rewritten() -> None:
    """The drive keeps an older copy of a shard whose write-back failed: the error fails the next
    acquire of any shard; after flush(after_error=True) that shard stays refused (its update
    exists nowhere else), the others go on; writing it anew clears it."""
    broken = {"on": False}
    store = LazyStore(fail=lambda op, key: op == "write" and key == "a" and broken["on"])
    sizes = {"a": 1024, "b": 1024, "c": 1024}
    _fill(store, sizes)
    broken["on"] = True
    ring = StagingRing(store, 2 * span(1024))  # two regions: "c" evicts "a"
    ring.plan(list(sizes.items()))
    for key in ("a", "b"):
        ring.release(ring.acquire(key, 1024))
    with pytest.raises(OSError, match="simulated write failure of a"):
        ring.acquire("c", 1024)
    ring.flush(after_error=True)
    broken["on"] = False
    with pytest.raises(RuntimeError, match="write-back of optimizer shard 'a'.*older copy"):
        ring.acquire("a", 1024)
    with pytest.raises(RuntimeError, match="shard 'a'"):
        ring.check("a")
    ring.check("b")
    ring.release(ring.acquire("b", 1024))
    ring.rewritten("a")
    ring.release(ring.acquire("a", 1024))
    ring.close()
    assert store.violations == []


def test_every_evicted_region_is_settled_even_when_one_fails() -> None:
    """One placement evicts three small regions and the first one's write-back fails: the other
    two are still waited for (no transfer is left untracked under reused memory)."""
    broken = {"on": False}
    store = LazyStore(fail=lambda op, key: op == "write" and key == "a" and broken["on"])
    sizes = {"a": 300, "b": 300, "c": 300, "big": 3 * ALIGN}
    _fill(store, sizes)
    broken["on"] = True
    ring = StagingRing(store, span(3 * ALIGN))
    ring.plan([(k, 300) for k in "abc"])
    for key in "abc":
        ring.release(ring.acquire(key, 300))
    ring.plan([("big", 3 * ALIGN)])
    with pytest.raises(OSError, match="simulated write failure of a"):
        ring.acquire("big", 3 * ALIGN)
    assert store.in_flight == []  # b's and c's write-backs were waited for too
    with pytest.raises(RuntimeError, match="shard 'a'"):
        ring.check("a")
    ring.close(after_error=True)


def test_a_replan_while_a_shard_is_being_read_unpins_it() -> None:
    """A shard the prefetch thread was reading when the plan changed must not stay pinned:
    the new plan's shards get its room."""
    gate = threading.Event()

    class SlowFirstRead(LazyStore):
        def read(self, key: str, dst: torch.Tensor) -> Handle:
            if key == "x":
                gate.wait(5)  # hold the prefetch thread inside the read submission
            return super().read(key, dst)
    store = SlowFirstRead()
    sizes = {"x": 1024, "y": 1024, "z": 1024}
    _fill(store, sizes)
    ring = StagingRing(store, span(1024))  # room for one shard at a time
    ring.plan([("x", 1024)])
    threading.Event().wait(0.05)
    ring.plan([("y", 1024), ("z", 1024)])
    gate.set()
    for _ in range(2000):  # the plan alone (no acquire, so no demand) must get "y" its room
        with ring._cond:  # noqa: SLF001
            if "y" in ring._index:  # noqa: SLF001
                break
        threading.Event().wait(0.001)
    assert "y" in ring._index and "x" not in ring._index  # noqa: SLF001
    ring.release(ring.acquire("y", 1024))
    ring.close()


def test_a_dead_prefetch_thread_fails_acquire_instead_of_hanging(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path)
    _fill(store, {"a": 1024})

    def broken(self: StagingRing) -> None:
        raise AssertionError("simulated bug")
    monkeypatch.setattr(StagingRing, "_next_job", broken)
    ring = StagingRing(store, span(1024))
    ring.plan([("a", 1024)])
    outcome: list[BaseException] = []

    def acquire() -> None:
        try:
            ring.acquire("a", 1024)
        except BaseException as exc:  # noqa: BLE001 -- inspected below
            outcome.append(exc)
    waiter = threading.Thread(target=acquire, daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "acquire() hangs when the prefetch thread is gone"
    assert len(outcome) == 1 and "prefetch thread stopped: AssertionError" in str(outcome[0])
    store.close()


def test_the_ring_budget(tmp_path: Path) -> None:
    """Sized by pinned_budget_bytes, capped at what every shard needs, never below the largest
    shard; a budget below three of the largest is warned about (no overlap then)."""
    from zero_offload.engine.step.pipeline import StateAccess

    store = _store(tmp_path)
    access = StateAccess(store, budget_bytes=100 * 4 * ALIGN)
    for n in (4 * ALIGN, 4 * ALIGN, ALIGN):
        access.add(n)
    assert access._capacity() == span(4 * ALIGN) * 2 + span(ALIGN) + span(4 * ALIGN)  # noqa: SLF001
    small = StateAccess(store, budget_bytes=4 * ALIGN)
    small.add(4 * ALIGN)
    with pytest.warns(UserWarning, match="fewer than three of the largest optimizer shard"):
        assert small._capacity() == span(4 * ALIGN)  # noqa: SLF001
    store.close()


def test_a_larger_shard_registered_later_replaces_the_ring(tmp_path: Path) -> None:
    """The ring is sized when first used; a shard added afterwards that does not fit gets a new
    ring (the old one's thread stopped), and the new one holds it."""
    from zero_offload.engine.step.pipeline import StateAccess

    store = _store(tmp_path)
    _fill(store, {"a": ALIGN, "b": 8 * ALIGN})
    access = StateAccess(store, budget_bytes=3 * 4 * span(ALIGN))
    access.add(ALIGN)
    old = access.ring()
    access.add(8 * ALIGN)
    assert not old._thread.is_alive()  # noqa: SLF001 -- closed, not leaked
    with pytest.warns(UserWarning, match="fewer than three"):
        access.plan([("b", 8 * ALIGN)])
    views, region = access.acquire("b", 8 * ALIGN)
    assert access.ring().capacity >= span(8 * ALIGN) and views[0].numel() == 8 * ALIGN
    access.release(region)
    access.close()
    store.close()


def test_a_plan_while_a_flush_settles_places_nothing_until_it_has() -> None:
    """flush() forgot the regions and settled them outside the lock: a plan from another thread
    meanwhile read 'a' into memory its own write-back was still being written from (a review's
    finding; the engine plans and flushes from one thread, so it was latent)."""
    gate, holding = threading.Event(), []

    class SlowWrite(LazyStore):
        def write(self, key: str, src: torch.Tensor) -> Handle:
            h = super().write(key, src)
            return Handle(lambda: (gate.wait(5) if holding else None, h.wait()), src)

    store = SlowWrite()
    _fill(store, {"a": 1024})
    holding.append(True)  # from now on a write-back is held open until the gate opens
    ring = StagingRing(store, span(1024))
    ring.plan([("a", 1024)])
    r = ring.acquire("a", 1024)
    ring.release(r)  # its write-back is held open by the gate
    flushing = threading.Thread(target=ring.flush)
    flushing.start()
    threading.Event().wait(0.1)  # flush is now settling 'a', waiting for its write-back
    ring.plan([("a", 1024)])
    threading.Event().wait(0.2)  # time for a prefetch thread that ignored the flush to read
    gate.set()
    flushing.join()
    assert store.violations == []
    ring.release(ring.acquire("a", 1024))  # once settled, the plan goes on
    ring.close()


def test_acquire_on_a_closed_ring_is_an_error_not_a_wait() -> None:
    store = LazyStore()
    _fill(store, {"a": 1024})
    ring = StagingRing(store, span(1024))
    ring.close()
    outcome: list[BaseException | None] = []

    def acquire() -> None:
        try:
            ring.acquire("a", 1024)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
    waiter = threading.Thread(target=acquire, daemon=True)  # it used to wait for ever
    waiter.start()
    waiter.join(10)
    assert outcome and isinstance(outcome[0], RuntimeError), outcome
    assert "the staging ring is closed: shard 'a' cannot be staged" in str(outcome[0])
