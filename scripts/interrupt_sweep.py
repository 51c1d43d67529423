"""The interrupt sweep in full: SIGINT at every distinct line (or, with --all, every line event)
the main thread runs in one training step and its save (and in a load), for each stage x tier x I/O backend,
and a table of what each left the engine in (docs/faults.md, "Ctrl-C anywhere").

    python scripts/interrupt_sweep.py [--all] [--stages 2 3] [--tiers cpu nvme] [--backends native aiofiles]
                                      [--what step load]

Each case runs in a child process (tests/_interrupt_sweep.py) under `--timeout`; a hang is
reported by the child's watchdog with every thread's stack. Exits 1 if any outcome is bad.
CI runs a sample of the same sweep (tests/test_interrupt_sweep.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COLUMNS = ("consistent@1", "consistent@2", "consistent@backward", "stopped", "not reached")


def run_case(stage: int, tier: str, backend: str, what: str, exhaustive: bool, timeout: float) -> dict[str, Any]:
    """One case's summary (the child's JSON line), or a row saying why there is none."""
    cmd = [sys.executable, os.path.join(ROOT, "tests", "_interrupt_sweep.py"), "--stage", str(stage),
           "--tier", tier, "--backend", backend, "--what", what] + (["--all"] if exhaustive else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    name = f"stage{stage}-{tier}-{backend}" + ("" if what == "step" else f"-{what}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"ran past {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    if proc.returncode != 0 or "counts" not in out:
        return {"case": name, "error": out.get("hang") and f"hang at {out['hang']}" or proc.stderr[-500:]}
    return out


def row(out: dict[str, Any]) -> str:
    if "error" in out:
        return f"| {out['case']} | " + " | ".join(["-"] * (3 + len(COLUMNS))) + f" | {out['error']} |"
    counts = out["counts"]
    cells = [str(out["events"]), str(out["distinct"]), str(out["points"])] + [str(counts.get(c, 0)) for c in COLUMNS]
    return f"| {out['case']} | " + " | ".join(cells) + f" | {len(out['bad'])} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every line event, not each distinct line once")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--tiers", nargs="+", default=["cpu", "nvme"])
    ap.add_argument("--backends", nargs="+", default=["native", "aiofiles"], help="for the nvme tier")
    ap.add_argument("--what", nargs="+", default=["step", "load"], help="what the points interrupt")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per case")
    args = ap.parse_args()
    print("| case | line events | distinct lines | points | " + " | ".join(COLUMNS) + " | bad |")
    print("|---" * (5 + len(COLUMNS)) + "|")
    bad = 0
    cases = [(stage, tier, backend, what) for what in args.what for stage in args.stages for tier in args.tiers
             for backend in (args.backends if tier == "nvme" else ["auto"])]
    for stage, tier, backend, what in cases:
        out = run_case(stage, tier, backend, what, args.all, args.timeout)
        print(row(out), flush=True)
        for b in out.get("bad", []):
            print(f"    BAD {b['point']} {b['where']}: {b['outcome']} {b['detail']}", file=sys.stderr)
        bad += len(out.get("bad", [])) + ("error" in out)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
