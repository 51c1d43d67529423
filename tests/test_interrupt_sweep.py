"""Ctrl-C anywhere in a training step: the sweep (tests/_interrupt_sweep.py) delivers SIGINT at
sampled lines the main thread runs in step 2 and its save (or in a load), at stages 2 and 3, on the cpu and
nvme tiers and both I/O backends, and every outcome must be consistent or stopped, never mixed,
wedged, leaking or hung. Each case runs in a child process under a timeout (a hang inside it is
reported by its watchdog with every thread's stack). The exhaustive sweep is
scripts/interrupt_sweep.py (docs/faults.md)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.config import Config
from zero_offload.engine.phase import EngineStateError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (stage, tier, backend, what, every): every N-th distinct line of step 2 + its save, or of a
# load (400-1100 distinct lines per case), spread so the cases together stay well under a minute.
CASES = [(2, "cpu", "auto", "step", 20), (2, "nvme", "native", "step", 24), (2, "nvme", "aiofiles", "step", 50),
         (3, "cpu", "auto", "step", 24), (3, "nvme", "native", "step", 32), (3, "nvme", "aiofiles", "step", 70),
         (2, "cpu", "auto", "load", 16), (3, "nvme", "native", "load", 20)]


def run_sweep(stage: int, tier: str, backend: str, what: str, every: int, timeout: float = 150.0) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ZO_SWEEP_POINT_S": "20"}
    cmd = [sys.executable, str(HERE / "_interrupt_sweep.py"), "--stage", str(stage), "--tier", tier,
           "--backend", backend, "--what", what, "--every", str(every)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"sweep exited {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("stage,tier,backend,what,every", CASES)
def test_an_interrupt_at_any_line_of_a_step_leaves_it_consistent_or_stopped(stage: int, tier: str, backend: str,
                                                                          what: str, every: int) -> None:
    if backend == "native":
        from zero_offload.io.native_aio import native_lib

        if native_lib() is None:
            pytest.skip("native library not built")
    out = run_sweep(stage, tier, backend, what, every)
    assert out["bad"] == [], json.dumps(out["bad"][:5], indent=1)
    reached = sum(n for k, n in out["counts"].items() if k != "not reached")
    assert reached >= 0.8 * out["points"] and out["points"] >= 10, out  # the sweep is not vacuous
    ends = ("consistent@1", "stopped") if what == "load" else ("consistent@1", "consistent@2")
    assert all(out["counts"].get(k, 0) for k in ends), out


def _engine(tmp_path: Path) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    cfg = Config(stage=2, precision={"dtype": "fp32"}, tiers={"optimizer": "cpu", "grads": "cpu"},
                 bucket_bytes=8 * 9 * 4, optimizer={"lr": 0.01})
    return zero_offload.initialize(model, cfg)


def _step(eng: Any, i: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
    eng.backward(eng(x).pow(2).mean())
    eng.step()


def test_a_ctrl_c_during_step_is_raised_after_it_and_a_second_one_stops_the_engine(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGINT during step() is held until the step is whole (counted: step 2, the
    weights step 2's); two SIGINTs end the step at once and stop the engine with a one-line
    reason, until load_checkpoint brings it back."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job ignores SIGINT
    try:
        _interrupt_twice(tmp_path, monkeypatch)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eng = _engine(tmp_path)
    _step(eng, 1)
    eng.save_checkpoint(str(tmp_path / "ck"))
    so = eng.runtime.shard_optimizer
    real = so.finish_step

    def signalled(times: int) -> Any:
        def finish(*args: Any, **kwargs: Any) -> bool:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode
            return real(*args, **kwargs)
        return finish
    monkeypatch.setattr(so, "finish_step", signalled(1))
    with pytest.raises(KeyboardInterrupt):
        _step(eng, 2)
    assert eng.global_steps == 2 and set(so.steps.values()) == {2} and eng.stopped is None
    eng.load_checkpoint(str(tmp_path / "ck"))
    monkeypatch.setattr(so, "finish_step", signalled(2))
    with pytest.raises(KeyboardInterrupt):
        _step(eng, 2)
    assert eng.stopped is not None and "second Ctrl-C" in eng.stopped and "\n" not in eng.stopped
    with pytest.raises(EngineStateError, match="second Ctrl-C.*load a checkpoint"):
        _step(eng, 3)
    monkeypatch.setattr(so, "finish_step", real)
    eng.load_checkpoint(str(tmp_path / "ck"))
    _step(eng, 2)
    assert eng.global_steps == 2 and set(so.steps.values()) == {2}
    eng.close()


@pytest.mark.parametrize("where", ["makedirs", "rename"])
def test_a_save_to_a_read_only_or_full_drive_names_the_file_and_the_drive(where: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Making `<path>.tmp` on a read-only drive, or the swap's rename on a full one, raised a
    bare OSError; now it is the one-line CheckpointError naming the file and the drive, the
    previous checkpoint stays and nothing is lost."""
    import errno

    from zero_offload.engine.state import files, save
    from zero_offload.engine.state.files import CheckpointError

    eng = _engine(tmp_path)
    _step(eng, 1)
    ck = str(tmp_path / "ck")
    eng.save_checkpoint(ck)
    _step(eng, 2)
    if where == "makedirs":
        def fail(path: str, *args: Any, **kwargs: Any) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        monkeypatch.setattr(save.os, "makedirs", fail)
    else:
        def fail(src: str, dst: str) -> None:  # noqa: ARG001 -- an error that names no file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(files.os, "rename", fail)
    with pytest.raises(CheckpointError) as info:
        eng.save_checkpoint(ck)
    monkeypatch.undo()
    message = str(info.value)
    assert "\n" not in message and ck + ".tmp" in message and "on the drive mounted at" in message, message
    assert os.strerror(errno.EROFS if where == "makedirs" else errno.ENOSPC) in message
    assert eng.stopped is None
    eng.save_checkpoint(ck)  # nothing was lost: the same engine saves once the drive is back
    eng.load_checkpoint(ck)
    assert eng.global_steps == 2
    eng.close()


def test_a_second_ctrl_c_while_the_step_waits_for_its_worker_ends_it_without_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SIGINTs while step() waits for the worker (a deferred step: clip_grad_norm): the
    first is held, the second ends the wait at once. The job in flight finishes, the ones not
    begun are skipped (the drain took the second Ctrl-C for the first, held one, and stepped
    them all), the engine stops and a load brings it back."""
    from zero_offload.engine.step import pipeline as step_mod

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        cfg = Config(stage=2, precision={"dtype": "fp32"}, tiers={"optimizer": "cpu", "grads": "cpu"},
                     bucket_bytes=8 * 9 * 4, clip_grad_norm=1.0, optimizer={"lr": 0.01})
        eng = zero_offload.initialize(model, cfg)
        _step(eng, 1)
        eng.save_checkpoint(str(tmp_path / "ck"))
        real, calls = step_mod.HostAdam.__call__, []

        def kernel(self: object, *args: object) -> None:  # on the worker thread
            calls.append(1)
            if len(calls) == 1:  # two Ctrl-Cs, the second once the first is held (two at once are one)
                for done in (lambda: eng.interrupts.pending, lambda: eng.stopped is not None):
                    os.kill(os.getpid(), signal.SIGINT)
                    deadline = time.monotonic() + 5.0  # a bound, not a timing: the main thread handles it
                    while not done() and time.monotonic() < deadline:
                        time.sleep(0.001)
            real(self, *args)
        monkeypatch.setattr(step_mod.HostAdam, "__call__", kernel)
        with pytest.raises(KeyboardInterrupt):
            _step(eng, 2)
        monkeypatch.setattr(step_mod.HostAdam, "__call__", real)
        assert eng.stopped is not None and "second Ctrl-C" in eng.stopped
        assert len(calls) < len(eng.runtime.buckets), calls  # the jobs not begun were skipped
        eng.load_checkpoint(str(tmp_path / "ck"))
        _step(eng, 2)
        assert eng.global_steps == 2 and set(eng.runtime.shard_optimizer.steps.values()) == {2}
        eng.close()
    finally:
        signal.signal(signal.SIGINT, previous)
