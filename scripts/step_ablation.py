"""Where the overlapped step's time goes: the engine's step in variants, paired with plain fwd+bwd.

The measurement behind docs/perf_step.md's "what the step costs beyond fwd+bwd". Each round times
every variant once, right after an untimed run of itself, in an order shuffled anew every round
(seeded; `--order alternating` for bench-step's own alternating round-robin; both are
`bench.step._interleaved`): a fixed order lets a variant's place in the round bias it. The
figure per variant is the median over rounds of its time divided by the same round's plain
fwd+bwd (a paired ratio: load on the shared host falls on both), with a bootstrap 90% interval
of that median. "nvme again" is a second engine identical to "nvme": how far apart the two read
is this run's floor (session 7: 1-3% with 60 shuffled rounds, up to 6% with 30 alternating ones).

  fwd+bwd          the plain model, no engine
  fwd+bwd busy     the same while another process keeps the second core busy (a host effect:
                   on some virtual machines a busy sibling vCPU changes this one's speed)
  fwd+bwd + io     the same while a plain thread reads and writes every shard's state through an
                   nvme store and its staging ring (bench-step's nvme part): what the drive
                   traffic by itself costs the compute on this host, with no engine around it
  hooks only       the engine's forward/backward with its hooks, gradients dropped at the optimizer's
                   door: no Adam, no drive traffic, no helper thread at work
  nvme no adam     the nvme tier with a kernel that only copies the master out: all the drive traffic
                   and every helper thread, no Adam arithmetic
  nvme             the real step, optimizer state on nvme (what bench-step's `step` times)
  nvme again       the same, a second engine: the run's noise floor
  cpu              the real step, optimizer state in RAM (no drive traffic)

  python scripts/step_ablation.py [--rounds 60] [--tokens 192] [--nvme-path DIR] [--d-model 512 --layers 8]
                                  [--order shuffled|alternating] [--seed 0]

It patches two engine instances (hooks only, no Adam); it is a diagnostic, not an API.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from zero_offload.bench import step as bench  # noqa: E402


class _CopyOnly:
    """A host kernel that leaves the state as it is and writes the master out (no Adam)."""

    host = True

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 s: object, out: torch.Tensor | None) -> None:
        self.calls += 1
        if out is not None:
            out.copy_(master)


def _spin(busy: mp.synchronize.Event, stop: mp.synchronize.Event) -> None:
    """Integer arithmetic while `busy` is set (no memory traffic to speak of)."""
    while not stop.is_set():
        if not busy.wait(0.01):
            continue
        x = 0
        for i in range(20000):
            x += i * i


def _engines(args: argparse.Namespace, x: torch.Tensor, root: str) -> dict[str, tuple[object, Callable[[], None]]]:
    def make(name: str, tier: str) -> tuple[object, Callable[[], None]]:
        os.makedirs(os.path.join(root, name))
        ns = argparse.Namespace(d_model=args.d_model, layers=args.layers, tokens=args.tokens, tier=tier, bucket_mib=4.0,
                                threads=1, staging_mib=128.0)
        return bench._engine_step(ns, x, os.path.join(root, name), overlap=True)

    out = {"hooks only": make("hooks", "nvme"), "nvme no adam": make("noadam", "nvme"),
           "nvme": make("nvme", "nvme"), "nvme again": make("nvme2", "nvme"), "cpu": make("cpu", "cpu"),
           "io": make("io", "nvme")}  # its store only: the drive traffic beside plain fwd+bwd
    hooks = out["hooks only"][0].runtime  # type: ignore[attr-defined]
    hooks.reducer.sink = lambda bucket, shard: None  # the gradient goes nowhere: no job, no step
    hooks.shard_optimizer.prefetch = lambda: None  # and nothing is read ahead
    out["nvme no adam"][0].runtime.shard_optimizer.pipeline.kernel = _CopyOnly()  # type: ignore[attr-defined]
    return out


def _check_patches(engines: dict[str, tuple[object, Callable[[], None]]]) -> None:
    """Fail loudly if a patch above stopped taking effect (an engine attribute was renamed):
    the variant would otherwise time the whole step under another name."""
    hooks = engines["hooks only"][0].runtime.shard_optimizer  # type: ignore[attr-defined]
    if any(hooks.steps.values()):
        raise SystemExit("step_ablation: the 'hooks only' engine stepped its optimizer; the patch no longer holds")
    kernel = engines["nvme no adam"][0].runtime.shard_optimizer.pipeline.kernel  # type: ignore[attr-defined]
    if not isinstance(kernel, _CopyOnly) or kernel.calls == 0:
        raise SystemExit("step_ablation: the 'nvme no adam' engine did not run the copy-only kernel")


def _beside(plain: Callable[[], None], io: Callable[[], None]) -> bench._Part:
    """Plain fwd+bwd timed while `io` runs on a thread of its own; the thread is joined untimed
    (the drive traffic may outlast the compute) and its error, if any, raised there."""
    running: list[threading.Thread] = []
    failed: list[BaseException] = []

    def io_catching() -> None:
        try:
            io()
        except BaseException as exc:  # raised on the main thread by join()
            failed.append(exc)

    def run() -> None:
        thread = threading.Thread(target=io_catching, name="ablation-io", daemon=True)
        thread.start()
        running.append(thread)
        plain()

    def join() -> None:
        while running:
            running.pop().join()
        if failed:
            raise RuntimeError("step_ablation: the drive traffic beside fwd+bwd failed") from failed.pop()

    def untimed() -> None:
        run()
        join()
    return bench._Part(run, setup=untimed, settle=join)


def _interval(ratios: list[float], seed: int, draws: int = 2000) -> tuple[float, float]:
    """Bootstrap 90% interval of the median of `ratios` (resampled rounds)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[draws // 20], medians[draws - 1 - draws // 20]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--order", choices=("shuffled", "alternating"), default="shuffled",
                    help="order of the variants within a round (default: shuffled anew every round)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the shuffles and the bootstrap (default 0)")
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--d-model", type=int, default=512, help="as bench-step (default 512)")
    ap.add_argument("--layers", type=int, default=8, help="as bench-step (default 8)")
    ap.add_argument("--nvme-path", default=None, help="directory on the drive (default: a temp dir)")
    ap.add_argument("--malloc", choices=("tuned", "default"), default="tuned", help="as bench-step (default tuned)")
    args = ap.parse_args()
    allocator = bench.steady_allocator(args.malloc)
    torch.set_num_threads(1)
    x = torch.randn(args.tokens, args.d_model)
    ctx = mp.get_context("spawn")
    busy, stop = ctx.Event(), ctx.Event()
    spinner = ctx.Process(target=_spin, args=(busy, stop), daemon=True)
    spinner.start()
    plain = bench._fwd_bwd(args, x)

    def busy_plain() -> None:
        busy.set()
        try:
            plain()
        finally:
            busy.clear()

    with tempfile.TemporaryDirectory(dir=args.nvme_path) as root:
        engines = _engines(args, x, root)
        io_engine, _ = engines.pop("io")
        # Each run timed right after an untimed run of itself, as bench-step times its parts.
        parts = {"fwd+bwd": bench._Part(plain, setup=plain), "fwd+bwd busy": bench._Part(busy_plain, setup=busy_plain),
                 "fwd+bwd + io": _beside(plain, bench._nvme_only(io_engine))}
        for name, (engine, run) in engines.items():
            access = engine.runtime.shard_optimizer.access  # type: ignore[attr-defined]
            parts[name] = bench._Part(run, setup=run, settle=access.flush)  # the ring emptied after, untimed
        before = bench._cpu_times()
        times = bench._interleaved(parts, args.rounds, args.seed if args.order == "shuffled" else None)
        steal = bench._steal_pct(before, bench._cpu_times())
        _check_patches(engines)
        for engine, _ in [*engines.values(), (io_engine, None)]:
            engine.close()  # type: ignore[attr-defined]
    stop.set()
    spinner.join(timeout=5)
    print(f"step ablation: {args.tokens} rows, {args.rounds} paired rounds ({args.order} order), "
          f"cpu steal {steal or 0.0:.1f}%; allocator: {allocator}")
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times["fwd+bwd"])]
        lo, hi = _interval(ratios, args.seed)
        print(f"  {name:14} {statistics.median(ts) * 1e3:7.1f} ms   paired / fwd+bwd {statistics.median(ratios):6.3f}"
              f"   90% interval {lo:.3f}-{hi:.3f}")


if __name__ == "__main__":
    main()
