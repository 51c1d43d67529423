"""scripts/step_ablation.py patches engine internals to time the step's variants: a renamed
attribute must fail the script, not let a variant time the whole step under another name."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "step_ablation.py")
VARIANTS = ("fwd+bwd", "fwd+bwd busy", "fwd+bwd + io", "hooks only", "nvme no adam", "nvme", "nvme again", "cpu")


@pytest.mark.parametrize("order", ["shuffled", "alternating"])
def test_step_ablation_runs_every_variant(tmp_path: object, order: str) -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--rounds", "2", "--tokens", "8", "--d-model", "64",
                          "--layers", "2", "--nvme-path", str(tmp_path), "--order", order],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert f"({order} order)" in lines[0], lines[0]
    names = [line[2:16].strip() for line in lines[1:]]
    assert names == list(VARIANTS), out.stdout
    assert all("90% interval" in line for line in lines[1:]), out.stdout


def _script() -> object:
    spec = importlib.util.spec_from_file_location("step_ablation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_fwd_bwd_beside_io_runs_both_at_once_and_reports_the_io_error() -> None:
    """The `fwd+bwd + io` variant is only a floor if the traffic really runs beside the compute
    (this io waits for the compute to start: run one after the other, it would time out) and
    if a failed transfer fails the run instead of timing a fwd+bwd with nothing beside it."""
    started = threading.Event()

    def io() -> None:
        if not started.wait(10):
            raise TimeoutError("the io never saw the compute start")

    part = _script()._beside(started.set, io)  # type: ignore[attr-defined]
    part.run()
    part.settle()

    def broken() -> None:
        raise OSError("the drive went away")

    part = _script()._beside(lambda: None, broken)  # type: ignore[attr-defined]
    part.run()
    with pytest.raises(RuntimeError, match="drive traffic beside fwd\\+bwd failed"):
        part.settle()
