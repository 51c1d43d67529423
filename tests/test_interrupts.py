"""Ctrl-C and I/O failures at the worst moments leave a state training can go on from.

Interrupts are simulated deterministically: a function on the main thread raises
KeyboardInterrupt at a chosen call (never a signal and a sleep), as the default SIGINT handler
does between two Python calls.
"""
from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.config import Config
from zero_offload.engine.state import checkpoint, files
from zero_offload.engine.step import pipeline as step_mod
from zero_offload.engine.engine import EngineStateError
from zero_offload.engine.step.pipeline import updated_buffer
from zero_offload.engine.stage3.unit import GatherBuffers as StagingPool, Unit
from zero_offload.io.base import DoneFuture
from zero_offload.store import make_store
from zero_offload.store.base import Handle

WAIT_S = 5.0  # a bound on every wait below: a broken fix fails instead of hanging CI
WIDTH = 32


def _engine(tmp_path: Path, tier: str = "nvme", stage: int = 2, layers: int = 4, **extra: Any) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    tiers = {"optimizer": tier, "grads": "cpu"}
    if stage == 3:
        tiers["params"] = tier
        extra.setdefault("stage3", {"resident_bytes": 0})
    else:
        extra.setdefault("bucket_bytes", WIDTH * WIDTH * 4)  # a bucket per weight, one for the biases
    cfg = Config(stage=stage, precision={"dtype": "fp32"}, tiers=tiers, nvme_paths=(str(tmp_path / "nvme"),),
                 optimizer={"lr": 0.01, "weight_decay": 0.0}, **extra)
    os.makedirs(tmp_path / "nvme", exist_ok=True)
    return zero_offload.initialize(model, cfg)


def _step(eng: Any, i: int) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
    eng.backward(eng(x).pow(2).mean())
    eng.step()


def _masters(eng: Any) -> dict[str, torch.Tensor]:
    so = eng.runtime.shard_optimizer
    return {k: so.master(k) for k in so.numel}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _weights(eng: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.consolidated_state_dict().items()}


class _InterruptingCondition(threading.Condition):
    """The step pipeline's lock: the main thread's first wait once `when()` holds raises
    KeyboardInterrupt, as Ctrl-C does to a thread blocked in engine.step()."""

    def __init__(self, when: Callable[[], bool]) -> None:
        super().__init__()
        self.when, self.fired = when, False

    def wait(self, timeout: float | None = None) -> bool:
        if self.fired or threading.current_thread() is not threading.main_thread():
            return super().wait(timeout)
        if self.when():
            self.fired = True
            raise KeyboardInterrupt
        return super().wait(0.002)  # not yet: look again soon (callers wait in a loop)


# ---- bug 1: Ctrl-C in step() ----------------------------------------------------------------
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_ctrl_c_during_step_hands_over_every_shard_the_worker_stepped(tier: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while step() waits for the worker: the worker finishes the step on every shard
    (the ones not begun too: their gradients are there), every shard is counted and installed,
    then the interrupt is raised -- each shard's step count, master and compute copy are an
    uninterrupted run's after step 2, so training goes on with Adam's bias correction right.
    (It used to skip the shards not begun, leaving them a step behind the others.)"""
    ref = _engine(tmp_path / "ref", tier)
    _step(ref, 1)
    _step(ref, 2)
    after2 = _masters(ref)
    ref.close()

    eng = _engine(tmp_path / "run", tier)
    so, pipeline = eng.runtime.shard_optimizer, eng.runtime.shard_optimizer.pipeline
    _step(eng, 1)
    real, calls, entered = step_mod.HostAdam.__call__, {"n": 0}, threading.Event()
    interrupted = _InterruptingCondition(entered.is_set)

    def kernel(self: object, *args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # in flight when Ctrl-C comes: it finishes only once the interrupt landed
            entered.set()
            deadline = time.monotonic() + WAIT_S
            while not interrupted.fired and time.monotonic() < deadline:
                time.sleep(0.001)
        real(self, *args)
    monkeypatch.setattr(step_mod.HostAdam, "__call__", kernel)
    monkeypatch.setattr(pipeline, "_idle", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _step(eng, 2)
    monkeypatch.setattr(step_mod.HostAdam, "__call__", real)

    assert interrupted.fired
    masters = _masters(eng)
    assert len(masters) == 5 and all(so.steps[k] == 2 for k in masters), so.steps
    for k, master in masters.items():
        assert torch.equal(master, after2[k]), k
    for b in eng.runtime.buckets:  # the compute copy is what the master holds
        flat = torch.cat([p.detach().reshape(-1) for p in b.params])
        assert torch.equal(flat, masters[b.key][:flat.numel()]), b.key
    _step(eng, 3)  # training goes on, every shard from step 2
    assert {k: so.steps[k] for k in masters} == {k: 3 for k in masters}
    eng.close()


def _interrupt_once_counted(pipeline: Any) -> Callable[..., Any]:
    """A trace function: KeyboardInterrupt at the first line `_hand_over` runs after it counted a
    job as handed, as Ctrl-C does between two bytecodes (the window the test is about)."""
    seen: dict[str, Any] = {"handed": None, "fired": False}

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not seen["fired"]:
            if seen["handed"] is not None and pipeline._handed > seen["handed"]:
                seen["fired"] = True
                raise KeyboardInterrupt
            seen["handed"] = pipeline._handed
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is step_mod.StepPipeline._hand_over.__code__ and not seen["fired"] else None
    tracer.seen = seen  # type: ignore[attr-defined]
    return tracer


@pytest.mark.parametrize("stage", [2, 3])
def test_ctrl_c_just_after_a_shard_is_counted_as_handed_over_stops_the_engine(stage: int, tmp_path: Path) -> None:
    """The shard was counted as handed over before its hand-over (step count, compute copy) ran:
    Ctrl-C between the two left its compute copy behind its master and its step count short,
    and training went on from there. Now the hand-over counts as failed and the engine stops
    until a checkpoint is loaded; the load resumes as if nothing happened."""
    eng = _engine(tmp_path / "run", "cpu", stage=stage)
    _step(eng, 1)
    eng.save_checkpoint(str(tmp_path / "ckpt"))
    tracer = _interrupt_once_counted(eng.runtime.shard_optimizer.pipeline)
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            _step(eng, 2)
    finally:
        sys.settrace(None)
    assert tracer.seen["fired"]  # type: ignore[attr-defined]
    with pytest.raises(EngineStateError, match="while handing over a stepped shard.*load a checkpoint"):
        _step(eng, 3)
    eng.load_checkpoint(str(tmp_path / "ckpt"))
    _step(eng, 2)
    ref = _engine(tmp_path / "ref", "cpu", stage=stage)
    _step(ref, 1)
    _step(ref, 2)
    assert _same(_weights(eng), _weights(ref))
    ref.close()
    eng.close()


# ---- bug 2: Ctrl-C while a write-back is waited on ------------------------------------------
def test_an_interrupted_handle_wait_can_be_waited_again() -> None:
    calls: list[str] = []

    def finish() -> None:
        calls.append("wait")
        if len(calls) == 1:
            raise KeyboardInterrupt

    h = Handle(finish)
    with pytest.raises(KeyboardInterrupt):
        h.wait()
    h.wait()  # the transfer may still be running: wait() waits again
    h.wait()  # and once it finished, never again
    assert calls == ["wait", "wait"]
    failed = Handle(lambda: (_ for _ in ()).throw(OSError(errno.EIO, "gone")))
    with pytest.raises(OSError):
        failed.wait()
    failed.wait()  # an error ends the transfer


def _interrupt_first_main_thread_wait(store: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """From now on the store's writes complete only when waited for; the first such wait on the
    main thread is interrupted (Ctrl-C), after which the write goes on and succeeds."""
    real, state = store.write, {"interrupts": 0, "armed": 1}

    def write(key: str, src: torch.Tensor) -> Handle:
        handle = real(key, src)

        def finish() -> None:
            if state["armed"] and threading.current_thread() is threading.main_thread():
                state["armed"], state["interrupts"] = 0, state["interrupts"] + 1
                raise KeyboardInterrupt
            handle.wait()
        return Handle(finish, src)
    monkeypatch.setattr(store, "write", write)
    return state


def test_ctrl_c_while_save_waits_for_a_write_back_is_not_a_failed_write(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while save_checkpoint waits for an optimizer write-back: the write was not failed
    and is still waited for; the next save and step work, and training matches an
    uninterrupted run exactly."""
    ref = _engine(tmp_path / "ref")
    for i in (1, 2, 3):
        _step(ref, i)
    expected = _masters(ref)
    ref.close()

    eng = _engine(tmp_path / "run")
    _step(eng, 1)
    state = _interrupt_first_main_thread_wait(eng.runtime.shard_optimizer.store, monkeypatch)
    _step(eng, 2)  # its last write-backs are still in flight when step() returns
    with pytest.raises(KeyboardInterrupt):
        eng.save_checkpoint(str(tmp_path / "ck"))
    assert state["interrupts"] == 1
    assert not os.path.exists(tmp_path / "ck.tmp")  # the interrupted save left nothing behind
    eng.save_checkpoint(str(tmp_path / "ck"))
    _step(eng, 3)
    assert _same(_masters(eng), expected)
    eng.load_checkpoint(str(tmp_path / "ck"))
    _step(eng, 3)
    assert _same(_masters(eng), expected)
    eng.close()


def test_an_interrupted_wait_for_a_units_shard_write_keeps_it_in_flight(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 3's compute-copy shard writes: an interrupted settle leaves the write in flight (a
    fetch meanwhile still copies its values from memory) and the next settle waits for it."""
    store, unit = _nvme_unit(tmp_path)
    key = unit.groups[0].key
    values = torch.arange(unit.groups[0].layout.shard_numel, dtype=torch.float32)
    state = _interrupt_first_main_thread_wait(store, monkeypatch)
    unit.write_shard(key, values)
    with pytest.raises(KeyboardInterrupt):
        unit.settle_write(key)
    assert state["interrupts"] == 1
    assert unit._pending_write(key) is not None  # still in flight: readers take it from memory
    unit.settle_write(key)
    assert unit._pending_write(key) is None
    assert torch.equal(unit.read_shard(key), values)
    store.close()


class _FreeThenInterrupt:
    """The native library, except that the first zo_aio_free returns into a KeyboardInterrupt;
    a request freed is never waited on or freed again (that would be a use after free)."""

    def __init__(self, lib: Any) -> None:
        self.lib, self.freed, self.misuse, self.fired = lib, set(), [], False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lib, name)

    def zo_aio_wait(self, req: int) -> int:
        if req in self.freed:
            self.misuse.append("wait")
            return 0
        return self.lib.zo_aio_wait(req)

    def zo_aio_free(self, req: int) -> None:
        if req in self.freed:
            self.misuse.append("free")
            return
        self.lib.zo_aio_free(req)
        self.freed.add(req)
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def test_an_interrupted_native_wait_never_frees_a_request_twice(tmp_path: Path) -> None:
    from zero_offload.io.native_aio import NativeAIO, native_lib

    if native_lib() is None:
        pytest.skip("native library not built")
    aio = NativeAIO(threads=1, queue_depth=1, block_size=4096)
    path = str(tmp_path / "f")
    buf = updated_buffer(1024, torch.float32, torch.device("cpu")).copy_(torch.arange(1024))  # O_DIRECT: aligned
    fut = aio.write(path, 0, buf)
    fut._lib = lib = _FreeThenInterrupt(fut._lib)
    with pytest.raises(KeyboardInterrupt):
        fut.wait()
    fut.wait()
    assert lib.misuse == [] and fut.done()
    back = updated_buffer(1024, torch.float32, torch.device("cpu"))
    aio.read(path, 0, back).wait()
    assert torch.equal(back, buf)
    aio.close()


# ---- bug 3: loading a checkpoint after failed writes ----------------------------------------
def _fail_writes(swap: Any) -> Callable[[], None]:
    """The drive fails (EIO) every write of `swap` until the returned function is called."""
    real = swap._submit

    def submit(e: Any, write: bool, *args: Any) -> Any:
        return DoneFuture(OSError(errno.EIO, "Input/output error")) if write else real(e, write, *args)
    swap._submit = submit
    return lambda: setattr(swap, "_submit", real)


def _recovers_by_loading(tmp_path: Path, stage: int, failing: tuple[int, ...], layers: int = 4) -> None:
    """Save, then steps whose drive writes fail; the first load_checkpoint restores the engine,
    and training from there matches a fresh engine that loaded the same checkpoint."""
    ck = str(tmp_path / "ck")
    eng = _engine(tmp_path / "run", stage=stage, layers=layers)
    _step(eng, 1)
    eng.save_checkpoint(ck)
    rt = eng.runtime
    store = rt.params_store if stage == 3 else rt.shard_optimizer.store
    restore = _fail_writes(store._swap)
    for i in failing:  # at stage 3 these steps fail; at stages 0-2 the write-backs are not waited for
        try:
            _step(eng, i)
        except (RuntimeError, OSError):  # the failed write, or the refused read of its slot
            pass
    restore()
    eng.load_checkpoint(ck)  # the first try: the failed write is superseded, not raised
    _step(eng, 2)
    _step(eng, 3)
    got = _weights(eng)
    eng.close()

    ref = _engine(tmp_path / "ref", stage=stage, layers=layers)
    ref.load_checkpoint(ck)
    _step(ref, 2)
    _step(ref, 3)
    assert _same(got, _weights(ref))
    ref.close()


def test_a_load_after_failed_write_backs_succeeds_at_once_stage2(tmp_path: Path) -> None:
    _recovers_by_loading(tmp_path, 2, failing=(2,))  # the write-backs still in flight at the load


def test_a_load_after_failed_shard_writes_succeeds_at_once_stage3(tmp_path: Path) -> None:
    # Three units: the failed step leaves the failed write of one still unsettled at the load.
    _recovers_by_loading(tmp_path, 3, failing=(2, 3), layers=3)


def test_a_replacing_write_supersedes_a_failed_one_and_a_plain_write_reports_it(tmp_path: Path) -> None:
    """Unit.write_shard(replacing=True) (a checkpoint load rebuilding the shard) waits for the
    earlier, failed write of its key without raising it; a plain write still raises it."""
    store, unit = _nvme_unit(tmp_path)
    key = unit.groups[0].key
    n = unit.groups[0].layout.shard_numel

    def shard(value: float) -> torch.Tensor:  # page-aligned: submitted to the drive at once, not bounced later
        return updated_buffer(n, torch.float32, torch.device("cpu")).fill_(value)
    restore = _fail_writes(store._swap)
    unit.write_shard(key, shard(0.0))
    restore()
    with pytest.raises(OSError, match="Input/output error"):
        unit.write_shard(key, shard(1.0))
    unit.write_shard(key, shard(0.0))  # the failed write was settled (and raised) above
    restore = _fail_writes(store._swap)
    unit.write_shard(key, shard(0.0))
    restore()
    unit.write_shard(key, shard(2.0), replacing=True)
    assert torch.equal(unit.read_shard(key), torch.full((n,), 2.0))
    store.close()


# ---- bug 4: a checkpoint onto a full disk ---------------------------------------------------
def test_a_save_to_a_full_disk_names_the_file_and_leaves_the_old_checkpoint(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up part way through a save: one line naming the file and ENOSPC, no
    `<path>.tmp` left behind, the previous checkpoint intact and loadable."""
    ck = str(tmp_path / "ck")
    eng = _engine(tmp_path / "run", tier="cpu")
    _step(eng, 1)
    eng.save_checkpoint(ck)
    saved = _weights(eng)
    _step(eng, 2)
    room = {"bytes": 3000}  # some files fit, then the disk is full

    class FullDisk:
        def __init__(self, f: Any) -> None:
            self.f = f

        def write(self, data: Any) -> int:
            n = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data)
            if n > room["bytes"]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            room["bytes"] -= n
            return self.f.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> "FullDisk":
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    def full_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = open(path, mode, *args, **kwargs)
        return FullDisk(f) if "w" in mode else f
    monkeypatch.setattr(files, "open", full_open, raising=False)
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)):  # as a path, torch would bypass the full disk above
            with full_open(f, "wb") as fo:
                return real_save(obj, fo, *args, **kwargs)
        return real_save(obj, f, *args, **kwargs)
    monkeypatch.setattr(checkpoint.torch, "save", save)
    with pytest.raises(checkpoint.CheckpointError) as info:
        eng.save_checkpoint(ck)
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message
    assert str(tmp_path / "ck.tmp") + os.sep in message  # the file it could not write
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck", "run"]
    eng.load_checkpoint(ck)
    assert _same(_weights(eng), saved)
    eng.close()


# ---- bug 5: close after a read-ahead nobody used failed -------------------------------------
def test_close_does_not_raise_a_read_ahead_nobody_used(tmp_path: Path) -> None:
    """A shard read ahead for a step that never comes fails its checksum: engine.close() is
    quiet (no step used it); a step that reads it would report it."""
    eng = _engine(tmp_path / "run")
    _step(eng, 1)
    so = eng.runtime.shard_optimizer
    so.pipeline.quiesce()  # every write-back done, nothing held in the ring
    path = so.store._swap.slot(next(iter(so.numel))).path
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    so.prefetch()  # reads ahead into the ring; one read fails its checksum
    eng.close()


def _nvme_unit(tmp_path: Path) -> tuple[Any, Unit]:
    """A stage-3 unit of one Linear over an nvme params store of its own."""
    cfg = Config(stage=3, tiers={"params": "nvme", "optimizer": "nvme", "grads": "cpu"},
                 nvme_paths=(str(tmp_path),), precision={"dtype": "fp32"})
    store = make_store("nvme", "params", cfg, device=torch.device("cpu"), rank=0, capacity_bytes=1 << 20)
    lin = nn.Linear(8, 8)
    unit = Unit(0, "lin", [(n, p, p.shape) for n, p in lin.named_parameters()], dtype=torch.float32,
                device=torch.device("cpu"), store=store, staging=StagingPool(store))
    return store, unit
