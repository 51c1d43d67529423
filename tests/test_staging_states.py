"""The staging ring's state machines (engine/step/staging_ring.py): a region's move from a state
that does not allow it, and the ring's, raise StagingStateError -- also under `python -O`, where
the `assert`s they used to be vanished and let a region be released twice."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine.step import staging_ring
from zero_offload.engine.step.staging_ring import Region, RegionState, RingState, StagingRing, StagingStateError, span
from zero_offload.store import make_store
from zero_offload.store.base import Store

def _store(tmp_path: Path) -> Store:
    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),))
    return make_store("nvme", "optimizer", cfg, device=torch.device("cpu"), rank=0, capacity_bytes=8 << 20)


@pytest.mark.parametrize("moves, message", [
    (("end_step",), "end_step needs state STEPPING, it is LOADING"),
    (("loaded", "pin"), "pin needs state CLEAN, it is PENDING"),
    (("loaded", "begin_step", "unpin"), "unpin needs state PENDING, it is STEPPING"),
    (("loaded", "unpin", "loaded"), "loaded needs state LOADING, it is CLEAN"),
])
def test_a_region_refuses_a_move_its_state_does_not_allow(moves: tuple[str, ...], message: str) -> None:
    region = Region("a", 0, 8, span(8))
    args = {"loaded": ([],), "end_step": ([],)}
    for move in moves[:-1]:
        getattr(region, move)(*args.get(move, ()))
    before = region.state
    with pytest.raises(StagingStateError, match=f"shard 'a': {message}"):
        getattr(region, moves[-1])(*args.get(moves[-1], ()))
    assert region.state is before  # refused, not half done


def test_releasing_a_region_twice_is_our_error(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.allocate("a", 3 * 1024, torch.float32)
    store.write("a", torch.zeros(3 * 1024)).wait()
    ring = StagingRing(store, 3 * span(1024))
    region = ring.acquire("a", 1024)
    assert ring.ring_state is RingState.READY
    ring.release(region)
    assert region.state is RegionState.CLEAN
    with pytest.raises(StagingStateError, match="end_step needs state STEPPING, it is CLEAN"):
        ring.release(region)
    ring.close()
    assert ring.ring_state is RingState.CLOSED
    with pytest.raises(StagingStateError, match="cannot go to PLACING from CLOSED"):
        ring._move(RingState.PLACING)  # noqa: SLF001 -- what the prefetch thread would do next
    store.close()


def test_a_failed_read_moves_the_ring_through_its_failure_states(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """READ_FAILED (nobody's error yet), STEP_FAILED once an acquire raised it, READY after flush."""
    store = _store(tmp_path)
    store.allocate("b", 3 * 1024, torch.float32)
    ring = StagingRing(store, 3 * span(1024))

    def failing(key: str, dst: torch.Tensor) -> object:
        raise OSError(5, "simulated read failure")
    monkeypatch.setattr(store, "read", failing)
    ring.plan([("b", 1024)])
    with ring._cond:  # noqa: SLF001
        ring._cond.wait_for(lambda: ring.ring_state is RingState.READ_FAILED, timeout=30)  # noqa: SLF001
    assert ring.ring_state is RingState.READ_FAILED
    with pytest.raises(OSError, match="simulated"):
        ring.acquire("b", 1024)
    assert ring.ring_state is RingState.STEP_FAILED
    with pytest.raises(OSError, match="simulated"):
        ring.flush()
    assert ring.ring_state is RingState.READY
    ring.close()
    store.close()


def test_a_wrong_move_raises_under_python_O(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -O` strips asserts: the refusal must not be one. The module is compiled here as -O
    compiles it (optimize=1: asserts and `if __debug__` blocks dropped), in this process, since a
    `python -O` child recompiles all of torch without cached bytecode (20 s on a shared machine)."""
    exec(compile("assert False", "<-O>", "exec", optimize=1))  # stripped indeed
    path = Path(staging_ring.__file__)
    stripped = types.ModuleType("zo_staging_ring_O")
    stripped.__file__ = str(path)
    monkeypatch.setitem(sys.modules, stripped.__name__, stripped)  # @dataclass looks its module up
    exec(compile(path.read_text(), str(path), "exec", optimize=1), stripped.__dict__)
    region = stripped.Region("a", 0, 8, stripped.span(8))
    with pytest.raises(stripped.StagingStateError, match="end_step needs state STEPPING, it is LOADING"):
        region.end_step([])
    assert region.state is stripped.RegionState.LOADING
