"""scripts/step_ablation.py patches engine internals to time the step's variants: a renamed
attribute must fail the script, not let a variant time the whole step under another name."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "step_ablation.py")
VARIANTS = ("fwd+bwd", "fwd+bwd busy", "hooks only", "nvme no adam", "nvme", "cpu")


def test_step_ablation_runs_every_variant(tmp_path: object) -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--rounds", "1", "--tokens", "8", "--d-model", "64",
                          "--layers", "2", "--nvme-path", str(tmp_path)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    names = [line[2:16].strip() for line in out.stdout.splitlines()[1:]]
    assert names == list(VARIANTS), out.stdout
