"""The engine's lifecycle under faults: a close() that fails, SIGTERM and pre-emption, exit
without close(). Every subprocess runs under a timeout (subprocess's own, and _dist's)."""
from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.config import Config, ConfigError
from zero_offload.io.aio import native_lib
from zero_offload.io import swap_files
from zero_offload.io.swap_files import SwapError

from tests._dist import run_ranks

ROOT = Path(zero_offload.__file__).resolve().parent.parent  # the children import the package under test
CHILD = [sys.executable, str(Path(__file__).resolve().parent / "_lifecycle_child.py")]
CHILD_TIMEOUT_S = 120
WIDTH = 32


def _engine(nvme: Path, **extra: Any) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    nvme.mkdir(exist_ok=True)
    cfg = Config(stage=2, precision={"dtype": "fp32"}, tiers={"optimizer": "nvme", "grads": "nvme"},
                 nvme_paths=(str(nvme),), optimizer={"lr": 0.01, "weight_decay": 0.0}, **extra)
    return zero_offload.initialize(model, cfg)


def _step(eng: Any, i: int) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
    eng.backward(eng(x).pow(2).mean())
    eng.step()


def _swap_files(nvme: Path) -> list[str]:
    return sorted(str(p) for p in nvme.glob("zero_offload-*/swap.bin"))


def _read_only(paths: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the write bit off the folders. Root ignores modes, so as root deleting an entry of a
    folder without the owner's write bit is refused here as the kernel refuses it for a user."""
    for p in paths:
        p.chmod(0o500)
    if os.geteuid() != 0:
        return
    real_unlink, real_rmdir = os.unlink, os.rmdir

    def check(path: Any) -> None:
        if not os.stat(os.path.dirname(os.path.abspath(path))).st_mode & stat.S_IWUSR:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(os, "unlink", lambda path, *a, **kw: (check(path), real_unlink(path, *a, **kw))[1])
    monkeypatch.setattr(os, "rmdir", lambda path, *a, **kw: (check(path), real_rmdir(path, *a, **kw))[1])


# ---- close() that fails ----------------------------------------------------------------------

def test_failed_close_names_the_files_left_and_a_second_close_removes_them(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """It raised a bare PermissionError for one swap.bin, and every later close() did nothing:
    the files stayed, and a new engine on the path was refused ("in use by another engine of
    this process ... close() it first") for the rest of the process."""
    nvme = tmp_path / "nvme"
    eng = _engine(nvme)
    _step(eng, 0)
    files = _swap_files(nvme)
    assert len(files) == 3  # optimizer, gradients and gradient accumulation: three stores, one FilesLeft
    dirs = [Path(f).parent for f in files]
    _read_only(dirs, monkeypatch)
    with pytest.raises(SwapError) as info:
        eng.close()
    msg = str(info.value)
    assert isinstance(info.value, swap_files.FilesLeft)
    assert "\n" not in msg and "they remain on disk" in msg and "call close() again" in msg
    assert all(f"{f} (Permission denied)" in msg for f in files), msg
    assert _swap_files(nvme) == files
    with pytest.raises(SwapError):  # still read-only: tried again, fails again
        eng.close()
    for d in dirs:
        d.chmod(0o700)
    eng.close()
    assert list(nvme.iterdir()) == []
    eng.close()  # idempotent
    again = _engine(nvme)
    _step(again, 1)
    again.close()
    assert list(nvme.iterdir()) == []


def test_files_a_failed_close_left_are_reused_by_a_new_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path is released however close() ends: a new engine takes the files over, as after a
    crash, and the old engine's next close() leaves them to it."""
    nvme = tmp_path / "nvme"
    eng = _engine(nvme)
    _step(eng, 0)
    files = _swap_files(nvme)
    dirs = [Path(f).parent for f in files]
    _read_only(dirs, monkeypatch)
    with pytest.raises(SwapError):
        eng.close()
    monkeypatch.undo()
    for d in dirs:
        d.chmod(0o700)
    again = _engine(nvme)  # reuses the files in place
    eng.close()  # nothing of the old engine's is left to remove
    assert _swap_files(nvme) == files
    _step(again, 1)
    again.close()
    assert list(nvme.iterdir()) == []


def test_a_live_engine_still_holds_its_path(tmp_path: Path) -> None:
    eng = _engine(tmp_path / "nvme")
    with pytest.raises(SwapError, match="in use by another engine of this process"):
        _engine(tmp_path / "nvme")
    eng.close()


# ---- SIGTERM and pre-emption -----------------------------------------------------------------

def _start_training(workdir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen([*CHILD, "loop", str(workdir), *extra], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not (workdir / "ready").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"training child never got ready (rc {proc.wait()}): {proc.stderr.read()}")
        time.sleep(0.05)
    return proc


def _terminate(proc: subprocess.Popen, signum: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the child did not end within {CHILD_TIMEOUT_S} s of SIGTERM: {err}")
    return proc.returncode, err


def test_sigterm_leaves_no_swap_files(tmp_path: Path) -> None:
    """SIGTERM's default action ended the process without atexit: the full-size preallocated
    swap files stayed on disk."""
    rc, err = _terminate(_start_training(tmp_path))
    assert rc == -signal.SIGTERM, err  # still ended by the signal, as without the library
    assert list((tmp_path / "nvme").iterdir()) == [], err


def test_sigterm_with_handle_signals_saves_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    """There was no way to save on pre-emption."""
    rc, err = _terminate(_start_training(tmp_path, "--preempt"))
    assert rc == 128 + signal.SIGTERM, err
    assert err == "", err
    assert list((tmp_path / "nvme").iterdir()) == []
    assert (tmp_path / "ckpt").is_dir() and int((tmp_path / "saved_steps").read_text()) >= 2
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([*CHILD, "resume", str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("resumed at step ")
    assert list((tmp_path / "nvme").iterdir()) == []


def test_handle_signals_saves_at_the_next_boundary_and_restores_the_handlers(tmp_path: Path) -> None:
    """SIGUSR1 (SLURM's early warning) between two steps: the next step saves, closes and
    raises Preempted; a handler installed before the engine's is chained, then put back."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        eng = _engine(tmp_path / "nvme", gradient_accumulation_steps=2,
                      preemption={"handle_signals": True, "checkpoint_dir": str(tmp_path / "ckpt")})
        _step(eng, 0)
        _step(eng, 1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and not eng.closed
        _step(eng, 2)  # inside the accumulation cycle: no checkpoint there
        assert not (tmp_path / "ckpt").exists()
        with pytest.raises(zero_offload.Preempted) as info:
            _step(eng, 3)
        assert info.value.code == 128 + signal.SIGUSR1 and info.value.global_steps == 2
        assert eng.closed and list((tmp_path / "nvme").iterdir()) == []
        assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # the user's, back
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # no swap file held: the default again
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
        resumed = _engine(tmp_path / "nvme")
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        assert resumed.global_steps == 2
        resumed.close()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_handle_signals_needs_a_checkpoint_dir() -> None:
    with pytest.raises(ConfigError, match="'preemption.checkpoint_dir' = '' is invalid: "
                                          "preemption.handle_signals needs a directory"):
        Config(preemption={"handle_signals": True})
    with pytest.raises(ConfigError, match="'preemption.handle_signals' = 'yes' is invalid: expected bool"):
        Config(preemption={"handle_signals": "yes", "checkpoint_dir": "ckpt"})
    with pytest.raises(ConfigError, match=r"config mixes zero_offload keys \(preemption\) with DeepSpeed keys"):
        Config.from_dict({"zero_optimization": {"stage": 2}, "preemption": {"handle_signals": False}})


def _ranks_save_at_one_boundary(rank: int, world: int, workdir: str) -> None:
    eng = _engine(Path(workdir) / f"nvme{rank}",
                  preemption={"handle_signals": True, "checkpoint_dir": os.path.join(workdir, "ckpt")})
    _step(eng, 0)
    if rank == 1:  # only one rank is told
        os.kill(os.getpid(), signal.SIGTERM)
    try:
        _step(eng, 1)
    except zero_offload.Preempted as exc:
        assert exc.global_steps == 2 and exc.code == 143, exc
    else:
        raise AssertionError(f"rank {rank} was not pre-empted at the boundary after the signal")
    assert eng.closed and not os.listdir(Path(workdir) / f"nvme{rank}")
    resumed = _engine(Path(workdir) / f"nvme{rank}")
    resumed.load_checkpoint(os.path.join(workdir, "ckpt"))
    assert resumed.global_steps == 2
    resumed.close()


def test_every_rank_saves_at_the_same_boundary(tmp_path: Path) -> None:
    run_ranks(_ranks_save_at_one_boundary, 2, timeout=120, workdir=str(tmp_path))


# ---- exit without close() --------------------------------------------------------------------

BACKENDS = [pytest.param({}, "native", id="native",
                         marks=pytest.mark.skipif(native_lib() is None, reason="native library not built")),
            pytest.param({}, "aiofiles", id="aiofiles"),
            pytest.param({"ZERO_OFFLOAD_NATIVE": "0"}, "auto", id="no-native-library")]


@pytest.mark.parametrize("env, backend", BACKENDS)
def test_exit_without_close_prints_nothing(tmp_path: Path, env: dict, backend: str) -> None:
    """Without the native library it printed "RuntimeError: cannot schedule new futures after
    (interpreter) shutdown" tracebacks at most exits: a prefetch still reading at exit met the
    aiofiles thread pool already stopped by concurrent.futures' exit hook."""
    out = subprocess.run([*CHILD, "exit", str(tmp_path), "--backend", backend], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=CHILD_TIMEOUT_S)
    assert (out.returncode, out.stderr) == (0, "")
    assert list((tmp_path / "nvme").iterdir()) == []


def test_ctrl_c_without_close_prints_only_the_interrupt(tmp_path: Path) -> None:
    """The issue saw "cannot schedule new futures" tracebacks after the KeyboardInterrupt's own
    at most Ctrl-C exits without the native library; and the prefetch thread's copy into a unit
    the interrupted pass had freed crashed such a run about one time in three (fixed in
    engine/stage3/unit.py; tests/test_stage3_units.py pins it deterministically). A guard at this timing."""
    rc, err = _terminate(_start_training(tmp_path, env={"ZERO_OFFLOAD_NATIVE": "0"}), signal.SIGINT)
    assert rc == -signal.SIGINT, err  # Python ends an uncaught KeyboardInterrupt by SIGINT
    assert err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert list((tmp_path / "nvme").iterdir()) == []


# ---- the first checksums, computed on many threads at once -----------------------------------

_FIRST_TRANSFERS = """
import sys, torch
from zero_offload.config import IOConfig
from zero_offload.io.swap import SwapStore
n, keys = 4224, 8  # a page and a ragged tail each
st = SwapStore([sys.argv[1]], "t", 0, capacity_bytes=keys * 8192, io=IOConfig(backend="aiofiles"))
srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for _ in range(keys)]
for k in range(keys):
    st.register(f"k{k}", n)
for f in [st.write(f"k{k}", srcs[k]) for k in range(keys)]:
    f.wait()
for k in range(keys):
    out = torch.empty(n, dtype=torch.uint8)
    st.read(f"k{k}", out).wait()
    assert torch.equal(out, srcs[k])
st.close()
"""


@pytest.mark.skipif(native_lib() is None, reason="the race was in declaring the native checksum's signature")
def test_the_first_transfers_of_a_process_on_aiofiles_pass_their_checksums(tmp_path: Path) -> None:
    """The aiofiles backend's threads made the first native checksum calls together, and one
    could call before the signature was declared (the address passed as a C int): in three
    fresh processes of four, a block written first failed its checksum when read back."""
    for i in range(2):  # each a fresh process: the race is in the first calls only
        (tmp_path / str(i)).mkdir()
        out = subprocess.run([sys.executable, "-c", _FIRST_TRANSFERS, str(tmp_path / str(i))], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=CHILD_TIMEOUT_S)
        assert (out.returncode, out.stderr) == (0, ""), out.stderr
