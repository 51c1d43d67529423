"""The staging ring (engine/staging.py): read-ahead into regions sized to each shard, a prefetch
thread that never overwrites a region in use, any stepping order served, failures reported."""
from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine.staging import ALIGN, PARTS, RegionState, StagingRing, span
from zero_offload.store import make_store
from zero_offload.store.base import Store


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
