"""scripts/gpu_check.py must not rot between the rare sessions that have a GPU: its dry run on the
CPU passes every row (5 steps each: the rows must run; the engine matrices check 20-step fidelity),
names the stage-3 rows, and a broken row really fails (exit status 1)."""
from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from types import ModuleType

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "gpu_check.py")
STAGE3_ROWS = ["stage=3 params=device optimizer=device fp32", "stage=3 params=cpu optimizer=nvme fp32",
               "stage=3 params=nvme optimizer=nvme fp32", "stage=3 params=nvme optimizer=nvme bf16",
               "stage=3 params=cpu optimizer=cpu fp32 gradient_accumulation_steps=2",
               "stage=3 params=nvme optimizer=cpu fp32 resident_bytes="]


def _load_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (it is not a package), for the rows and main() themselves; registered
    while the test runs because dataclasses look their module up in sys.modules."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    spec.loader.exec_module(module)
    return module


def test_cpu_dry_run_passes_every_row_and_names_the_stage3_rows() -> None:
    done = subprocess.run([sys.executable, SCRIPT, "--cpu-dry-run", "--steps", "5"], capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "SKIPPED: CUDA synchronize timing" in out
    for row in [*STAGE3_ROWS, "fp16 overflow skips exactly one step, in a one-rank gloo group",
                "stage=2 optimizer=nvme grads=device fp32 deferred step, weights reloaded at step 3",
                "stage=3 params=cpu optimizer=cpu fp32 engine.gathered(modify=True) at step 3"]:
        assert any(line.startswith("ok    cpu " + row) for line in out.splitlines()), f"no passing row '{row}':\n{out}"
    assert "gpu_check: 0 failure(s)" in out


def test_a_wrong_reference_fails_its_row_and_a_crash_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    gc = _load_script(monkeypatch)
    wrong = functools.partial(gc.s3_reference.__wrapped__, lr=gc.LR * 1.1)
    monkeypatch.setattr(gc, "s3_reference", lambda steps, precision, device: wrong(steps, precision, device))
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def crash() -> None:
        raise RuntimeError("boom\nsecond line")

    with tempfile.TemporaryDirectory() as nvme:
        run = gc.Run(device, nvme, 3)
        tag = "stage=3 params=cpu optimizer=cpu fp32"
        row = functools.partial(gc.stage3_row, tag, run, "cpu", "cpu", "fp32")
        failures = gc.run_rows([("crash", crash), (tag, row)])
    assert failures[0] == "crash: RuntimeError: boom"
    assert len(failures) == 2 and failures[1].startswith(f"{tag}: loss rel err"), failures


def test_a_cuda_error_ends_the_run_and_names_the_rows_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an illegal access every later row would fail alike, hiding which row broke it."""
    gc = _load_script(monkeypatch)
    ran = []

    def poisoned() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    failures = gc.run_rows([("first", lambda: ran.append(1)), ("bad", poisoned), ("later", lambda: ran.append(3))])
    assert ran == [1]
    assert failures == ["bad: RuntimeError: CUDA error: an illegal memory access was encountered",
                        "later: not run (a CUDA error in an earlier row)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="in-process --cpu-dry-run needs CUDA hidden before torch starts")
def test_main_exits_1_when_a_row_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    gc = _load_script(monkeypatch)

    def fail() -> None:
        raise AssertionError("off")

    def rows(run: object, args: object) -> list:
        return [("passes", lambda: None), ("fails", fail)]

    monkeypatch.setattr(gc, "all_rows", rows)
    assert gc.main(["--cpu-dry-run"]) == 1
