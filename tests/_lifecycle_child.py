"""A training process for tests/test_lifecycle_faults.py, run as a script in a subprocess.

    python tests/_lifecycle_child.py MODE WORKDIR [--preempt] [--backend KIND]

MODE: `loop` trains until a signal (or Ctrl-C) ends it, writing WORKDIR/ready after two steps; `exit`
trains three steps and returns without close(); `resume` loads WORKDIR/ckpt, checks its step
count against WORKDIR/saved_steps, trains one more step and closes. Stage 3 with parameters and
optimizer state on NVMe (WORKDIR/nvme), so a prefetch is in flight whenever a step ends.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from torch import nn

import zero_offload

warnings.filterwarnings("ignore", message="adam_step_flat: native CPU Adam unavailable")
WIDTH = 32
_KEEP: list = []


def _engine(workdir: str, preempt: bool, backend: str) -> "zero_offload.engine.engine.Engine":
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    os.makedirs(os.path.join(workdir, "nvme"), exist_ok=True)
    cfg = {"stage": 3, "precision": {"dtype": "fp32"}, "nvme_paths": [os.path.join(workdir, "nvme")],
           "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"}, "stage3": {"resident_bytes": 0},
           "io": {"backend": backend}, "optimizer": {"lr": 0.01, "weight_decay": 0.0}}
    if preempt:
        cfg["preemption"] = {"handle_signals": True, "checkpoint_dir": os.path.join(workdir, "ckpt")}
    return zero_offload.initialize(model, cfg)


def _step(eng: "zero_offload.engine.engine.Engine", i: int) -> None:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))
    eng.backward(eng(x).pow(2).mean())
    eng.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["loop", "exit", "resume"])
    ap.add_argument("workdir")
    ap.add_argument("--preempt", action="store_true")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    eng = _engine(args.workdir, args.preempt, args.backend)
    _KEEP.append(eng)  # as a script's top-level engine: alive until the interpreter exits
    if args.mode == "exit":
        for i in range(3):
            _step(eng, i)
        return  # without close(): the engine's finalizer runs at exit
    if args.mode == "resume":
        eng.load_checkpoint(os.path.join(args.workdir, "ckpt"))
        with open(os.path.join(args.workdir, "saved_steps")) as f:
            saved = int(f.read())
        assert eng.global_steps == saved, (eng.global_steps, saved)
        _step(eng, saved)
        eng.close()
        print(f"resumed at step {saved}")
        return
    i = 0
    try:
        while True:
            _step(eng, i)
            i += 1
            if i == 2:
                open(os.path.join(args.workdir, "ready"), "w").close()

    except BaseException as exc:  # by name: the tests run this child against code without Preempted too
        if type(exc).__name__ == "Preempted":
            with open(os.path.join(args.workdir, "saved_steps"), "w") as f:
                f.write(str(exc.global_steps))
        raise


if __name__ == "__main__":
    sys.exit(main())
