"""`zero-offload bench-adam`: CPU Adam against torch and this machine's memory bandwidth.

Everything is measured in one process, in interleaved rounds (every case once per round, the
order reversed every other round, the median over rounds reported), because the machine is
shared and its bandwidth drifts. Ratios are the median of per-round ratios: both sides of a
ratio ran within seconds of each other, so drift between rounds cancels. Each timed
call starts after a pause (--pause-ms): torch's OpenMP threads spin for milliseconds after every
parallel op, and a case that started inside that window would share its cores with them.

  stream     in-place triad a += 0.5*b through torch on T threads: reads a and b, writes a, so
             12 bytes per element. This is the bandwidth an in-place optimizer step can hope for.
             Its arrays hold min(N, 32M) elements (128 MiB each), far past any cache.
  (a)        a plain fp32 AdamW step: torch fused, torch foreach, ours. Minimal traffic 28 B/param
             (read param, grad, m, v; write param, m, v).
  (b)        the offloaded step's whole job: bf16 gradient in, fp32 AdamW step, bf16 weights out.
             torch: grad32.copy_(grad16); fused step; out16.copy_(param) (into preallocated
             buffers, its best case). Ours: one pass. Minimal traffic 28 B/param either way
             (2 + 12 read, 12 + 2 written); torch moves more, which is the point.
  (c)        CPUAdamW over 100 tensors of N/100 against one tensor of N: per-call overhead.

GB/s are of the minimal traffic, so they compare like with like across cases. Each case gets
two figures: its median round and its best round; "of bw" divides each by the stream's figure
of the same kind (median by median, best by best), so both are like-for-like under the noise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any, Callable

import torch

from zero_offload.cli import parse_count
from zero_offload.config import MAX_THREADS
from zero_offload.optim import CPUAdamW, _native_adam, adam_step_flat

HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
LR = 1e-4
TARGETS = {  # the "done when", checked against this run's own figures
    "a_vs_torch_fused": 1.0, "a_vs_bandwidth": 0.90, "a_vs_bandwidth_best": 0.90, "b_vs_torch_same_work": 1.3,
    "c_many_vs_one": 1.05,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench-adam options."""
    parser.add_argument("--params", type=parse_count, default=100_000_000, help="elements per case (default 100M)")
    parser.add_argument("--threads", type=int, default=0, help="threads for ours and torch (0: every core we may use)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--pause-ms", type=float, default=50.0,
                        help="idle time before each timed call, so no case inherits spinning threads")
    parser.add_argument("--isa", choices=_native_adam.ISA_NAMES, default=None, help="force our kernel's path")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


TRIAD_MAX = 1 << 25


class _Arrays:
    """Every buffer, allocated once (34 bytes per param, with torch's moments) and shared."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.g32 = torch.randn(n, generator=gen).mul_(1e-2)  # fp32 grad; torch's upcast target in (b)
        self.g16 = self.g32.to(torch.bfloat16)
        self.ours = [torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]  # param, m, v
        self.ours_out = torch.empty(n, dtype=torch.bfloat16)
        self.torch_param = torch.nn.Parameter(self.ours[0].clone())
        self.torch_out = torch.empty(n, dtype=torch.bfloat16)
        self.triad = [torch.zeros(min(n, TRIAD_MAX)), torch.ones(min(n, TRIAD_MAX))]


class _Cases:
    """One callable per measured case; each advances its own step count."""

    def __init__(self, a: _Arrays, isa: str, threads: int) -> None:
        self.a, self.isa, self.threads, self.step = a, isa, threads, 0
        a.torch_param.grad = a.g32
        self.opt = torch.optim.AdamW([a.torch_param], lr=LR, weight_decay=HYPER["weight_decay"], fused=True)
        self.many, self.one = self._cpu_adam(100), self._cpu_adam(1)

    def _cpu_adam(self, pieces: int) -> CPUAdamW:
        """CPUAdamW over `pieces` views of our buffers, its state pre-seeded with views too."""
        p, m, v = self.a.ours
        edges = [p.numel() * i // pieces for i in range(pieces + 1)]
        params = [torch.nn.Parameter(p[lo:hi]) for lo, hi in zip(edges, edges[1:])]
        opt = CPUAdamW(params, lr=LR, weight_decay=HYPER["weight_decay"], isa=self.isa, threads=self.threads)
        for param, lo, hi in zip(params, edges, edges[1:]):
            param.grad = self.a.g32[lo:hi]
            opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": m[lo:hi], "exp_avg_sq": v[lo:hi]}
        return opt

    def stream(self) -> None:
        self.a.triad[0].add_(self.a.triad[1], alpha=0.5)

    def _torch(self, fused: bool) -> None:
        group = self.opt.param_groups[0]
        group["fused"], group["foreach"] = fused, not fused
        self.opt.step()

    def torch_fused(self) -> None:
        self._torch(True)

    def torch_foreach(self) -> None:
        self._torch(False)

    def torch_same_work(self) -> None:
        self.a.g32.copy_(self.a.g16)
        self._torch(True)
        self.a.torch_out.copy_(self.a.torch_param.detach())

    def _ours(self, grad: torch.Tensor, out: torch.Tensor | None, check: bool = False) -> None:
        self.step += 1
        p, m, v = self.a.ours
        adam_step_flat(p, grad, m, v, step=self.step, lr=LR, lowp_out=out, check_finite=check,
                       isa=self.isa, threads=self.threads, **HYPER)

    def ours_fp32(self) -> None:
        self._ours(self.a.g32, None)

    def ours_bf16(self) -> None:
        self._ours(self.a.g16, self.a.ours_out)

    def ours_bf16_checked(self) -> None:
        self._ours(self.a.g16, self.a.ours_out, check=True)

    def cpu_adam_many(self) -> None:
        self.many.step()

    def cpu_adam_one(self) -> None:
        self.one.step()


CASES: list[tuple[str, str, int]] = [  # (method, label, minimal bytes per element)
    ("stream", "stream: in-place triad a += 0.5*b (torch)", 12),
    ("torch_fused", "(a) fp32 step: torch AdamW fused", 28),
    ("torch_foreach", "(a) fp32 step: torch AdamW foreach", 28),
    ("ours_fp32", "(a) fp32 step: ours", 28),
    ("torch_same_work", "(b) bf16 in/out: torch upcast+fused+downcast", 28),
    ("ours_bf16", "(b) bf16 in/out: ours, one pass", 28),
    ("ours_bf16_checked", "(b) bf16 in/out: ours + check_finite", 28),
    ("cpu_adam_one", "(c) CPUAdamW, 1 tensor of N", 28),
    ("cpu_adam_many", "(c) CPUAdamW, 100 tensors of N/100", 28),
]


def _measure(cases: _Cases, rounds: int, pause: float) -> dict[str, list[float]]:
    """Seconds per case and round over interleaved rounds, after one untimed warm-up round."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    for r in range(rounds + 1):
        for name, _, _ in CASES if r % 2 else CASES[::-1]:
            fn: Callable[[], None] = getattr(cases, name)
            time.sleep(pause)
            start = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - start)
    return times


def _figures(n: int, times: dict[str, list[float]]) -> dict[str, Any]:
    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    rows = {}
    for name, label, nbytes in CASES:
        elements = min(n, TRIAD_MAX) if name == "stream" else n
        rate, best = elements / seconds[name], elements / min(times[name])
        rows[name] = {"label": label, "seconds": seconds[name], "gparam_per_s": rate / 1e9,
                      "gb_per_s": rate * nbytes / 1e9, "best_gb_per_s": best * nbytes / 1e9}
    stream = rows["stream"]
    for row in rows.values():
        row["of_bandwidth"] = row["gb_per_s"] / stream["gb_per_s"]
        row["best_of_best_bandwidth"] = row["best_gb_per_s"] / stream["best_gb_per_s"]
    bandwidth = stream["gb_per_s"]

    def per_round(slow: str, fast: str) -> float:  # median over rounds of time(slow)/time(fast)
        return statistics.median(a / b for a, b in zip(times[slow], times[fast]))

    ratios = {
        "a_vs_torch_fused": per_round("torch_fused", "ours_fp32"),
        "a_vs_torch_foreach": per_round("torch_foreach", "ours_fp32"),
        "a_vs_bandwidth": rows["ours_fp32"]["of_bandwidth"],
        "a_vs_bandwidth_best": rows["ours_fp32"]["best_of_best_bandwidth"],
        "b_vs_torch_same_work": per_round("torch_same_work", "ours_bf16"),
        "b_check_finite_cost": per_round("ours_bf16_checked", "ours_bf16"),
        "c_many_vs_one": per_round("cpu_adam_many", "cpu_adam_one"),
    }
    return {"rows": rows, "ratios": ratios, "bandwidth_gb_per_s": bandwidth}


def _met(key: str, value: float) -> str:
    target = TARGETS.get(key)
    if target is None:
        return ""
    ok = value <= target if key == "c_many_vs_one" else value >= target
    return f"(target {'<=' if key == 'c_many_vs_one' else '>='} {target:g}: {'met' if ok else 'NOT met'})"


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"bench-adam: {cfg['params']:,} params, {cfg['threads']} threads, our isa {cfg['isa']}, "
          f"torch {cfg['torch']}, median of {cfg['rounds']} interleaved rounds")
    print(f"{'':48} {'--------- median ---------':>26}   {'---- best ----':>14}")
    print(f"{'case':48} {'Gparam/s':>9} {'GB/s':>7} {'of bw':>6}   {'GB/s':>7} {'of bw':>6}")
    for row in report["rows"].values():
        print(f"{row['label']:48} {row['gparam_per_s']:9.3f} {row['gb_per_s']:7.1f} {row['of_bandwidth']:6.0%}"
              f"   {row['best_gb_per_s']:7.1f} {row['best_of_best_bandwidth']:6.0%}")
    for key, value in report["ratios"].items():
        print(f"  {key:24} {value:6.3f}  {_met(key, value)}")


def _check_args(args: argparse.Namespace) -> None:
    """Each flag on its own line of error, before any buffer is allocated. --pause-ms is a
    float: argparse takes "nan" and "inf", which time.sleep refuses without naming the flag."""
    for flag, value, low in (("--params", args.params, 1), ("--rounds", args.rounds, 1),
                             ("--threads", args.threads, 0)):
        if value < low:
            raise ValueError(f"bench-adam: {flag} {value}: must be >= {low}")
    if args.threads > MAX_THREADS:  # torch.set_num_threads crashes the process on a huge count
        raise ValueError(f"bench-adam: --threads {args.threads}: must be <= {MAX_THREADS}")
    if not math.isfinite(args.pause_ms) or args.pause_ms < 0:
        raise ValueError(f"bench-adam: --pause-ms {args.pause_ms}: must be a finite number >= 0")


def main(args: argparse.Namespace) -> int:
    """Run every case, print the table (or JSON); 0 whether or not the targets were met."""
    _check_args(args)
    if not _native_adam.available():
        raise OSError(f"bench-adam: the native CPU Adam is not available ({_native_adam.load_reason()})")
    threads = _native_adam.resolve_threads(args.threads)
    isa = _native_adam.resolve_isa(args.isa)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = _measure(_Cases(_Arrays(args.params), isa, threads), args.rounds, args.pause_ms / 1000)
    finally:
        torch.set_num_threads(previous)
    report = {"config": {"params": args.params, "threads": threads, "isa": isa, "rounds": args.rounds,
                         "pause_ms": args.pause_ms,
                         "torch": torch.__version__, "cpus": len(os.sched_getaffinity(0))},
              **_figures(args.params, seconds)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0
