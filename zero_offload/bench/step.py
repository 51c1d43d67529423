"""`zero-offload bench-step`: time an offloaded training step and how much of it overlaps.

Measured side by side in one run, on one model (a residual MLP stack, sized by --d-model,
--layers and --tokens so the three parts take similar time):
  fwd+bwd      forward and backward of the plain model, no engine
  cpu adam     the CPU Adam over every optimizer shard, state in RAM
  nvme         reading and writing every shard's master + m + v through the nvme store,
               through the same staging ring as the step (--staging-mib), no compute
  step         the engine's whole step (forward, backward, overlapped CPU Adam and NVMe traffic),
               timed right after an untimed step, as in a training loop (see _steady); fwd+bwd
               and cpu adam are likewise timed right after an untimed run of themselves
  serial step  the same with overlap_step off (Adam after backward)
and the overlap: step / max(fwd+bwd, cpu adam, nvme); 1.0 is perfect overlap. It also prints the
step by phase (forward, backward, step()) beside fwd+bwd's forward and backward. Every part runs
with glibc keeping freed memory (--malloc tuned, see steady_allocator), so the plain fwd+bwd is not
slowed by page faults the engine does not pay.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from zero_offload.config import MAX_THREADS
from zero_offload.optim.adamw import ADAMW
from zero_offload.tiers import tier


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.nn.functional.gelu(self.fc(x)))


def _model(d: int, layers: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[_Block(d) for _ in range(layers)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d-model", type=int, default=512, help="width of each block (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="residual MLP blocks (default 8)")
    parser.add_argument("--tokens", type=int, default=192,
                        help="rows per micro-batch (default 192: the NVMe traffic is ~0.6 of fwd+bwd)")
    parser.add_argument("--steps", type=int, default=9, help="timed rounds (default 9)")
    parser.add_argument("--tier", choices=("nvme", "cpu"), default="nvme", help="optimizer tier (default nvme)")
    parser.add_argument("--nvme-path", default=None, help="directory on the drive (default: a temp dir)")
    parser.add_argument("--bucket-mib", type=float, default=4.0, help="gradient bucket size in MiB (default 4)")
    parser.add_argument("--staging-mib", type=float, default=128.0,
                        help="pinned staging budget (pinned_budget_bytes) in MiB; keep it well below the "
                             f"optimizer state ({ADAMW.bytes_per_element} B/param) so every step really reads and writes the drive")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for fwd+bwd and CPU Adam threads each (default 1)")
    parser.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                        help="tuned (default): glibc keeps freed memory, so the plain fwd+bwd is timed without the "
                             "page faults its zero_grad causes; default: leave glibc as it is")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit


def steady_allocator(mode: str) -> str:
    """Set glibc's malloc so that freed tensor memory stays in the process ("tuned"), or leave
    it ("default"); returns a line saying which. With the defaults, a plain loop's
    zero_grad(set_to_none=True) frees every gradient at once, glibc hands the pages back to the
    kernel, and the next backward page-faults them in again: 10-30% of this model's fwd+bwd on
    the 2-vCPU machine we measured (docs/perf_step.md), while the engine, which frees each
    gradient as the step consumes it, hardly pays it. Comparing against a baseline slowed that
    way would flatter the step, so every part runs with the tuned allocator unless asked."""
    if mode == "default":
        return "glibc defaults (fwd+bwd may pay page faults the engine does not: see --malloc)"
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return "unchanged (not glibc)"
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(M_TRIM_THRESHOLD, 1 << 30)):
        return "unchanged (glibc's mallopt refused the thresholds)"
    return "glibc, mmap threshold 32 MiB and trim threshold 1 GiB: freed memory is reused, no part pays page faults"


def _nothing() -> None:
    pass


@dataclass
class _Part:
    """One measured part: `run` is timed; `setup` and `settle` run untimed just before and after."""

    run: Callable[[], None]
    setup: Callable[[], None] = _nothing
    settle: Callable[[], None] = _nothing


def _interleaved(parts: dict[str, _Part], rounds: int, shuffle_seed: int | None = None) -> dict[str, list[float]]:
    """Seconds of each part per round, measured round-robin (one of each per round) so that load
    from other processes on a shared machine falls on every part alike. Every other round runs
    the parts in reverse order, so no part always follows the same neighbour; with
    `shuffle_seed`, every round runs them in an order drawn anew (scripts/step_ablation.py: a
    fixed order lets a part's place in the round bias it)."""
    for part in parts.values():  # warm-up: allocations, first NVMe slot writes
        part.setup()
        part.run()
        part.settle()
    times: dict[str, list[float]] = {name: [] for name in parts}
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    for r in range(rounds):
        if rng is not None:
            order = [(name, parts[name]) for name in rng.sample(list(parts), len(parts))]
        else:
            order = list(parts.items() if r % 2 == 0 else reversed(parts.items()))
        for name, part in order:
            part.setup()
            t0 = time.perf_counter()
            part.run()
            times[name].append(time.perf_counter() - t0)
            part.settle()
    return times


class _PhaseLog:
    """Seconds per phase (forward, backward, step()) of a part's timed runs, not of its untimed
    setup runs: where the step's time goes, beside the same phases of plain fwd+bwd."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}  # written by the run itself
        self.timed: list[dict[str, float]] = []

    def timed_run(self, run: Callable[[], None]) -> Callable[[], None]:
        def go() -> None:
            run()
            self.timed.append(dict(self.last))
        return go

    def medians(self) -> dict[str, float]:
        rounds = self.timed[1:]  # the first is _interleaved's warm-up, not a timed round
        return {k: statistics.median(d[k] for d in rounds) for k in rounds[0]} if rounds else {}


def _steady(engine: object, step: Callable[[], None], unused: list[int],
            timed: Callable[[], None] | None = None) -> _Part:
    """The step as a training loop runs it: right after another (untimed) step, so the read-ahead
    that step started and its last write-backs run under the timed one, as they would under the
    next step's forward. Afterwards the ring is emptied, untimed: its read-ahead must not run
    under the next part (slowing it) nor fill the ring for free for the next timed step.
    `unused` collects the bytes read ahead and never stepped; `timed`, if given, is what the
    timed run calls (the step, logging its phases)."""
    access = engine.runtime.shard_optimizer.access  # type: ignore[attr-defined]

    def settle() -> None:
        unused[0] += access.flush()
    return _Part(timed or step, setup=step, settle=settle)


def _cpu_times() -> list[int] | None:
    """The machine's CPU time counters (/proc/stat's first line: user ... steal), None off Linux."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def _steal_pct(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of this machine's CPU time the hypervisor gave to other guests (steal) between two
    readings: a virtual machine's neighbours slow the two-thread step more than the one-thread
    fwd+bwd it is compared with, so the figure says how far to trust the ratio."""
    if before is None or after is None:
        return None
    delta = [b - a for a, b in zip(before, after)]
    return 100.0 * delta[7] / max(sum(delta), 1)


def _round_ratios(times: dict[str, list[float]], candidates: tuple[str, ...]) -> list[float]:
    """step / largest part within each round: the paired comparison, robust to load that
    changes from one round to the next (parts of one round run within about a second)."""
    return [step / max(times[k][i] for k in candidates) for i, step in enumerate(times["step"])]


def _fwd_bwd(args: argparse.Namespace, x: torch.Tensor, log: _PhaseLog | None = None) -> Callable[[], None]:
    model = _model(args.d_model, args.layers)
    log = log or _PhaseLog()

    def run() -> None:
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        t1 = time.perf_counter()
        loss.backward()
        model.zero_grad(set_to_none=True)
        log.last.update(forward=t1 - t0, backward=time.perf_counter() - t1)
    return run


def _shard_sizes(engine: object) -> list[int]:
    return [b.layout.shard_numel for b in engine.runtime.buckets]  # type: ignore[attr-defined]


def _adam_only(sizes: list[int], threads: int) -> Callable[[], None]:
    from zero_offload.engine.step.pipeline import HostAdam, Scalars

    kernel = HostAdam(threads)
    state = [(torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)) for n in sizes]
    s = Scalars(1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True)

    def run() -> None:
        for p, g, m, v in state:
            kernel(p, g, m, v, s, None)
    return run


def _nvme_only(engine: object) -> Callable[[], None]:
    """Read and write back every shard's state through the engine's own store and staging ring,
    with the same read-ahead as a step (the ring's prefetch thread), and no compute."""
    so = engine.runtime.shard_optimizer  # type: ignore[attr-defined]
    shards = so.planned()  # the store keys in stepping order (a shard larger than a third of the ring is stepped in sub-shards)

    def run() -> None:
        so.access.flush()  # forget what the ring holds: every shard is read from the drive
        so.access.plan(shards)
        for key, numel in shards:
            _, region = so.access.acquire(key, numel)
            so.access.release(region)
        so.access.flush()
    return run


def _traffic(engine: object) -> tuple[int, int]:
    """(bytes read, bytes written) on the drive so far by the engine's optimizer and grads stores."""
    so = engine.runtime.shard_optimizer  # type: ignore[attr-defined]
    pairs = [so.store.drive_traffic(), so.grad_store.drive_traffic()]
    return sum(r for r, _ in pairs), sum(w for _, w in pairs)


def _engine_step(args: argparse.Namespace, x: torch.Tensor, nvme: str, overlap: bool,
                 log: _PhaseLog | None = None) -> tuple[object, Callable[[], None]]:
    import zero_offload

    cfg = dict(stage=1, tiers={"optimizer": args.tier, "grads": "cpu"}, overlap_step=overlap,
               bucket_bytes=int(args.bucket_mib * 2**20), optimizer={"threads": args.threads},
               pinned_budget_bytes=int(args.staging_mib * 2**20),
               nvme_paths=[nvme] if tier(args.tier).needs_nvme_paths else [])
    engine = zero_offload.initialize(_model(args.d_model, args.layers), cfg)
    log = log or _PhaseLog()

    def run() -> None:
        t0 = time.perf_counter()
        loss = engine(x).pow(2).mean()
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        log.last.update({"forward": t1 - t0, "backward": t2 - t1, "step()": time.perf_counter() - t2})
        run.calls += 1  # type: ignore[attr-defined]
    run.calls = 0  # type: ignore[attr-defined]
    return engine, run


def _measure(args: argparse.Namespace, io_name: str) -> tuple[dict[str, list[float]], list[float], int, int,
                                                             float | None, dict[str, dict[str, float]]]:
    """Per-round seconds of every part, the overlapped engine's drive traffic per step
    (read, written), the optimizer state's bytes, the staging ring's, the CPU steal (%)
    during the rounds, and the median seconds per phase of fwd+bwd and of the step."""
    x = torch.randn(args.tokens, args.d_model)
    logs = {"fwd+bwd": _PhaseLog(), "step": _PhaseLog()}
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
        os.makedirs(os.path.join(nvme, "serial"))
        engine, step = _engine_step(args, x, nvme, overlap=True, log=logs["step"])
        serial_engine, serial = _engine_step(args, x, os.path.join(nvme, "serial"), overlap=False)
        sizes = _shard_sizes(engine)
        state_bytes = engine.runtime.shard_optimizer.spec.state_bytes(sum(sizes))  # type: ignore[attr-defined]
        unused = [0]
        fwd_bwd, adam = _fwd_bwd(args, x, logs["fwd+bwd"]), _adam_only(sizes, args.threads)
        # Each part right after an untimed run of itself, as a loop runs it (the nvme part reads
        # everything cold by design: the drive traffic alone); the step in the middle, next to
        # the parts it is compared with, in either order.
        parts = {"fwd+bwd": _Part(logs["fwd+bwd"].timed_run(fwd_bwd), setup=fwd_bwd), "cpu adam": _Part(adam, setup=adam),
                 "step": _steady(engine, step, unused, logs["step"].timed_run(step)),
                 io_name: _Part(_nvme_only(serial_engine)),
                 "serial step": _steady(serial_engine, serial, [0])}
        before, cpu_before = _traffic(engine), _cpu_times()
        times = _interleaved(parts, args.steps)
        steal = _steal_pct(cpu_before, _cpu_times())
        read, written = _traffic(engine)
        after = (read - unused[0], written)  # read-ahead for steps that never ran is not traffic
        ring_bytes = engine.runtime.shard_optimizer.access.staging_bytes  # type: ignore[attr-defined]
        per_step = [(a - b) / max(step.calls, 1) for a, b in zip(after, before)]  # type: ignore[attr-defined]
        engine.close()
        serial_engine.close()
    return times, per_step, state_bytes, ring_bytes, steal, {k: v.medians() for k, v in logs.items()}


def _summarize(args: argparse.Namespace, io_name: str, times: dict[str, list[float]],
               per_step: list[float], state_bytes: int, ring_bytes: int, steal: float | None,
               phases: dict[str, dict[str, float]]) -> dict:
    order = ("fwd+bwd", "cpu adam", io_name, "step", "serial step")  # the three parts, then the steps
    figures = {name: statistics.median(times[name]) for name in order}
    candidates = [figures[k] for k in ("fwd+bwd", "cpu adam", io_name)]
    ratios = _round_ratios(times, ("fwd+bwd", "cpu adam", io_name))
    params = sum(p.numel() for p in _model(args.d_model, args.layers).parameters())
    return {"params": params, "tokens": args.tokens, "tier": args.tier, "threads": args.threads,
            "seconds": figures, "phases": phases, "step_over_largest": statistics.median(ratios),
            "step_over_largest_per_round": ratios,
            "step_over_largest_of_medians": figures["step"] / max(candidates),
            "drive_bytes_per_step": {"read": per_step[0], "written": per_step[1]},
            "optimizer_state_bytes": state_bytes, "staging_ring_bytes": ring_bytes, "cpu_steal_pct": steal,
            "overlap_pct": 100.0 * (sum(candidates) - figures["step"]) / max(sum(candidates) - max(candidates), 1e-12)}


def _print(args: argparse.Namespace, result: dict) -> None:
    print(f"bench-step: {result['params'] / 1e6:.1f}M parameters, {args.tokens} rows, optimizer on {args.tier}, "
          f"{args.threads} thread(s) each; median of {args.steps} interleaved rounds")
    for name, sec in result["seconds"].items():
        print(f"  {name:24} {sec * 1e3:9.1f} ms")
    mib, traffic, ratios = 2.0 ** 20, result["drive_bytes_per_step"], result["step_over_largest_per_round"]
    print(f"  drive traffic per step   {traffic['read'] / mib:9.1f} MiB read, {traffic['written'] / mib:.1f} MiB "
          f"written (optimizer state: {result['optimizer_state_bytes'] / mib:.1f} MiB; "
          f"staging ring: {result['staging_ring_bytes'] / mib:.1f} MiB; averaged over every step run, timed or not)")
    if not tier(args.tier).resident and result["staging_ring_bytes"] >= result["optimizer_state_bytes"]:
        print("  warning: the staging ring holds the whole optimizer state, so a step may find its shards "
              "still in the ring and not read the drive; lower --staging-mib to measure the NVMe tier")
    print(f"  step / largest part      {result['step_over_largest']:9.2f} x   (median of the per-round ratios; "
          f"rounds {min(ratios):.2f}-{max(ratios):.2f}; of the medians above: "
          f"{result['step_over_largest_of_medians']:.2f} x)")
    print(f"  overlap                  {result['overlap_pct']:9.0f} %   of the time that could be hidden is hidden "
          f"(from the medians)")
    plain, step = result["phases"]["fwd+bwd"], result["phases"]["step"]
    if plain and step:
        print(f"  step by phase            forward {step['forward'] * 1e3:.1f} ms (fwd+bwd: {plain['forward'] * 1e3:.1f}), "
              f"backward {step['backward'] * 1e3:.1f} ms ({plain['backward'] * 1e3:.1f}), "
              f"step() {step['step()'] * 1e3:.1f} ms   (medians)")
    host = result["host"]
    print(f"  host                     {host['cpu']}, {host['cpus']} cpus, CPU Adam {host['adam_isa']}")
    print(f"  allocator                {result['allocator']}")
    if result["cpu_steal_pct"] is not None:
        print(f"  cpu steal                {result['cpu_steal_pct']:9.1f} %   of the machine's CPU time went to other "
              "virtual machines during the rounds (above ~3%, the host was contended: the ratio suffers)")


def _host() -> dict[str, object]:
    """What the figures were measured on: the overlap this bench measures depends on the host (its
    cores, its Adam kernel, its drive), so a figure without its host cannot be compared."""
    from zero_offload import native
    from zero_offload.optim import _native_adam

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    isa = _native_adam.default_isa() if native.lib() is not None else "torch fallback (native library not loaded)"
    return {"cpu": model, "cpus": len(os.sched_getaffinity(0)), "adam_isa": isa}


def _check_args(args: argparse.Namespace) -> None:
    """Every flag before anything is allocated: a zero or negative size fails deep inside torch
    (--threads 0, --steps 0) or, worse, runs and reports figures of an empty model (--d-model 0)."""
    for flag in ("d_model", "layers", "tokens", "steps", "threads"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"bench-step: --{flag.replace('_', '-')} {value}: must be >= 1")
    if args.threads > MAX_THREADS:  # torch.set_num_threads crashes the process on a huge count
        raise ValueError(f"bench-step: --threads {args.threads}: must be <= {MAX_THREADS} (the config's "
                         "optimizer.threads bound)")
    for flag in ("bucket_mib", "staging_mib"):
        value = getattr(args, flag)
        if not math.isfinite(value) or int(value * 2**20) < 1:  # the config takes whole bytes
            raise ValueError(f"bench-step: --{flag.replace('_', '-')} {value}: must be a finite number > 0 "
                             "(at least one byte)")
    if args.nvme_path is not None and not os.path.isdir(args.nvme_path):
        raise ValueError(f"bench-step: --nvme-path {args.nvme_path!r} is not an existing directory")


def main(args: argparse.Namespace) -> int:
    _check_args(args)
    allocator = steady_allocator(args.malloc)  # before any part allocates
    torch.set_num_threads(args.threads)
    io_name = "nvme" if not tier(args.tier).resident else "state copy (cpu tier)"
    result = _summarize(args, io_name, *_measure(args, io_name))
    result["allocator"], result["host"] = allocator, _host()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(args, result)
    return 0
