"""`zero-offload bench-step`: a tiny run prints every part, and the step really moves the state.

No timing is asserted (these machines are noisy); what is checked is that the benchmark measures
what it claims: every part is present, and the overlapped step read and wrote the whole optimizer
state on the drive each step when the staging ring is smaller than that state.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from zero_offload.bench import step as bench_step

_FAULTS = """
import resource, sys, torch
from zero_offload.bench.step import steady_allocator
line = steady_allocator(sys.argv[1])
def backward_like():  # sixteen 4 MiB gradients, then zero_grad(set_to_none=True) frees them all
    grads = [torch.ones(1 << 20) for _ in range(16)]
    del grads
for _ in range(4):  # the heap settles within three rounds
    backward_like()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    backward_like()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, line)
"""


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_step.add_arguments(parser)
    return parser.parse_args(argv)


# Four buckets of one weight each (16,384 elements) and one of the four biases (small parameters
# go last, together).
# `--malloc default`: the tuned allocator would stay set for the rest of this test process.
TINY = ["--d-model", "64", "--layers", "2", "--tokens", "8", "--steps", "1", "--bucket-mib", "0.07", "--malloc", "default"]


def test_tiny_run_reports_every_part_and_full_drive_traffic(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = _args(TINY + ["--staging-mib", "0.6", "--nvme-path", str(tmp_path), "--json"])
    assert bench_step.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["seconds"]) == {"fwd+bwd", "cpu adam", "nvme", "step", "serial step"}
    assert all(v > 0 for v in result["seconds"].values())
    state = result["optimizer_state_bytes"]
    assert state >= 12 * result["params"]  # master + m + v, 4 bytes each, padding included
    # A ring of three such shards (0.6 MiB) cannot hold four: taken in turn,
    # every shard is read before and written after its update, every step (no more: the
    # next step's read-ahead is not counted).
    assert result["drive_bytes_per_step"]["read"] == pytest.approx(state)
    assert result["drive_bytes_per_step"]["written"] == pytest.approx(state)
    assert result["step_over_largest_of_medians"] == pytest.approx(
        result["seconds"]["step"] / max(result["seconds"][k] for k in ("fwd+bwd", "cpu adam", "nvme")))
    ratios = result["step_over_largest_per_round"]
    assert len(ratios) == 1 and result["step_over_largest"] == pytest.approx(ratios[0])
    # Where the step's time goes, phase by phase, beside plain fwd+bwd: measured inside the one
    # timed run of each, so the phases add up to no more than the run.
    phases = result["phases"]
    assert set(phases["fwd+bwd"]) == {"forward", "backward"} and set(phases["step"]) == {"forward", "backward", "step()"}
    assert all(v > 0 for part in phases.values() for v in part.values())
    for part in ("fwd+bwd", "step"):
        assert sum(phases[part].values()) <= result["seconds"][part]
    steal = result["cpu_steal_pct"]
    assert steal is None or 0.0 <= steal <= 100.0
    host = result["host"]  # what the figures were measured on
    assert host["cpus"] >= 1 and host["cpu"] and host["adam_isa"] in ("scalar", "avx2", "avx512") + (
        "torch fallback (native library not loaded)",)
    assert list(tmp_path.iterdir()) == []  # the scratch directory is gone


def test_table_names_the_traffic_and_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert bench_step.main(_args(TINY + ["--staging-mib", "0.25", "--nvme-path", str(tmp_path)])) == 0
    out = capsys.readouterr().out
    for label in ("fwd+bwd", "cpu adam", "nvme", "serial step", "drive traffic per step", "step / largest part",
                  "step by phase            forward", "allocator                glibc defaults", "host                     "):
        assert label in out, out


def test_round_ratios_pair_each_step_with_its_own_round() -> None:
    times = {"step": [2.0, 3.0], "fwd+bwd": [1.0, 3.0], "cpu adam": [0.5, 0.5], "nvme": [1.6, 1.0]}
    assert bench_step._round_ratios(times, ("fwd+bwd", "cpu adam", "nvme")) == [1.25, 1.0]


def test_steal_share_comes_from_the_eighth_counter() -> None:
    before = [100, 0, 50, 800, 10, 0, 0, 40]
    after = [160, 0, 60, 900, 10, 0, 0, 70]  # 200 ticks in all, 30 of them stolen
    assert bench_step._steal_pct(before, after) == pytest.approx(15.0)
    assert bench_step._steal_pct(None, after) is None


def test_tuned_allocator_keeps_freed_gradients_from_page_faulting_back() -> None:
    """What `--malloc tuned` is for: gradients freed all at once (a plain loop's zero_grad) are
    reused by the next backward, not handed back to the kernel and faulted in again (glibc's
    defaults do that here: 16,352 faults in every round in most processes, settling to none in a
    few). In a fresh process: the setting is process-wide."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS, "tuned"], check=True, capture_output=True, text=True).stdout
    count, line = out.split(" ", 1)
    if line.startswith("unchanged"):
        pytest.skip("not glibc: nothing to tune")
    assert line.startswith("glibc, mmap threshold 32 MiB")
    assert int(count) < 64, f"{count} page faults in four rounds of 64 MiB after four to settle"
