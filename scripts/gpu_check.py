#!/usr/bin/env python
"""The engine on CUDA in under 5 minutes: equivalence with the AdamW reference, then overlap.

1. Stages 0-2 x optimizer tier (device, cpu, nvme) x fp32/bf16: 20 steps of the tests' TinyLM on
   the GPU against the single-process reference on the same GPU (same tolerances as the CPU tests),
   and fp16 with one poisoned step that must be skipped.
2. Overlap: a residual MLP stack on the GPU with the optimizer on pinned CPU (and on nvme): fwd+bwd
   alone, CPU Adam alone, the overlapped step and the serial step (overlap_step off), measured
   round-robin in one run. The overlapped step should be close to max(fwd+bwd, adam).
Exit status 0 when every equivalence check passed. Run: python scripts/gpu_check.py [--nvme DIR]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import zero_offload  # noqa: E402
from _engine_model import batch, make_model, reference_run  # noqa: E402
from test_engine_matrix import LR, TOL, compare  # noqa: E402


def equivalence(nvme: str) -> list[str]:
    failures = []
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ref_losses, ref_w = reference_run(20, 4, dtype, lr=LR, device="cuda")
        for stage in (0, 1, 2):
            for tier in ("device", "cpu", "nvme"):
                tag = f"cuda stage={stage} tier={tier} {precision}"
                cfg = dict(stage=stage, precision={"dtype": precision}, bucket_bytes=6000,
                           tiers={"optimizer": tier, "grads": tier}, optimizer={"lr": LR, "weight_decay": 0.01},
                           nvme_paths=[nvme] if tier == "nvme" else [])
                engine = zero_offload.initialize(make_model(), cfg)
                losses = []
                for step in range(20):
                    x, y = batch(step, 4)
                    loss = engine(x.cuda(), y.cuda())
                    engine.backward(loss)
                    engine.step()
                    losses.append(float(loss))
                try:
                    compare(tag, losses, engine.consolidated_state_dict(), ref_losses, ref_w, TOL[precision])
                    print(f"ok    {tag}")
                except AssertionError as exc:
                    failures.append(str(exc))
                    print(f"FAIL  {exc}")
                engine.close()
    failures += fp16_skip()
    return failures


def fp16_skip() -> list[str]:
    engine = zero_offload.initialize(make_model(), dict(stage=2, precision={"dtype": "fp16", "initial_scale_power": 8},
                                                        tiers={"optimizer": "cpu", "grads": "cpu"}))
    applied = []
    for step in range(5):
        x, y = batch(step, 4)
        loss = engine(x.cuda(), y.cuda())
        engine.backward(loss * math.inf if step == 2 else loss)
        applied.append(engine.step())
    engine.close()
    ok = applied == [True, True, False, True, True] and engine.skipped_steps == 1
    print(f"{'ok   ' if ok else 'FAIL '} cuda fp16 overflow skips exactly one step: {applied}")
    return [] if ok else [f"fp16 skip: {applied}"]


def _mlp(d: int, layers: int) -> torch.nn.Module:
    from zero_offload.bench.step import _model

    return _model(d, layers)


def _timed(fn, rounds: int) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def overlap(nvme: str, d: int, layers: int, tokens: int, rounds: int = 5) -> None:
    from zero_offload.engine.step import HostAdam, Scalars

    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    plain = _mlp(d, layers).cuda().bfloat16()
    params = sum(p.numel() for p in plain.parameters())

    def fwd_bwd() -> None:
        plain(x).float().pow(2).mean().backward()
        plain.zero_grad(set_to_none=True)

    engines = {}
    for name, tier, ov in (("step (cpu, overlapped)", "cpu", True), ("step (cpu, serial)", "cpu", False),
                           ("step (nvme, overlapped)", "nvme", True)):
        cfg = dict(stage=1, precision={"dtype": "bf16"}, tiers={"optimizer": tier, "grads": "cpu"}, overlap_step=ov,
                   bucket_bytes=32 << 20, nvme_paths=[os.path.join(nvme, name[-11:-1])] if tier == "nvme" else [])
        if tier == "nvme":
            os.makedirs(cfg["nvme_paths"][0], exist_ok=True)
        engines[name] = zero_offload.initialize(_mlp(d, layers), cfg)
    adam, s = HostAdam(0), Scalars(1, 1e-4, 0.9, 0.999, 1e-8, 0.01, True)
    shards = [(torch.randn(n), torch.randn(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n),
               torch.empty(n, dtype=torch.bfloat16))
              for n in (b.layout.shard_numel for b in next(iter(engines.values())).runtime.buckets)]

    def adam_only() -> None:
        for p, g, m, v, out in shards:
            adam(p, g, m, v, s, out)

    def engine_step(e) -> callable:  # noqa: ANN001
        def run() -> None:
            e.backward(e(x).float().pow(2).mean())
            e.step()
        return run

    parts = {"fwd+bwd (gpu)": fwd_bwd, "cpu adam": adam_only, **{k: engine_step(e) for k, e in engines.items()}}
    for fn in parts.values():
        _timed(fn, 1)
    times = {k: [] for k in parts}
    for _ in range(rounds):
        for k, fn in parts.items():
            times[k] += _timed(fn, 1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\noverlap benchmark: {params / 1e6:.0f}M parameters, bf16, {tokens} rows; median of {rounds} rounds")
    for k, v in med.items():
        print(f"  {k:26} {v * 1e3:9.1f} ms")
    largest = max(med["fwd+bwd (gpu)"], med["cpu adam"])
    print(f"  overlapped cpu step / max(fwd+bwd, adam) = {med['step (cpu, overlapped)'] / largest:.2f}x; "
          f"serial = {med['step (cpu, serial)'] / largest:.2f}x")
    for e in engines.values():
        e.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme", default=None, help="directory for the nvme tier (default: a temp dir)")
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this script checks the CUDA paths only", file=sys.stderr)
        return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=args.nvme) as nvme:
        failures = equivalence(nvme)
        overlap(nvme, args.d_model, args.layers, args.tokens)
    print(f"\ngpu_check: {len(failures)} failure(s) in {time.time() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
