"""scripts/step_ablation.py patches engine internals to time the step's variants: a renamed
attribute must fail the script, not let a variant time the whole step under another name."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "step_ablation.py")
VARIANTS = ("fwd+bwd", "fwd+bwd busy", "hooks only", "nvme no adam", "nvme", "nvme again", "cpu")


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
