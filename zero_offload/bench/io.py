"""`zero-offload bench-io`: how fast this drive moves data through our async I/O.

Two phases on one test file (always removed, on Ctrl-C too):
  1. sweep block size x queue depth x threads x backend, one sequential O_DIRECT write and read
     pass each, to find the best settings;
  2. compare at those settings: our backends, and fio with the same pattern when it is on PATH,
     in interleaved rounds (ours, aiofiles, fio, ours, ...) because the drive's speed drifts
     between runs; the medians give the our/fio ratios.
It ends with the best settings as a config snippet (`--write-config` saves it as JSON that
`Config.from_file` reads).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import sys
from typing import Any, Callable, Iterator, Sequence

from zero_offload.bench.io_runners import FioRunner, OurRunner, Pattern
from zero_offload.config import ALIGN_BYTES, ConfigError, IOConfig

OPS = ("write", "read")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """'4GiB', '8M', '512k', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 4GiB, 8MiB, 512K)")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def _size_list(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",")]


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="directory on the drive to measure")
    parser.add_argument("--size", type=parse_size, default=parse_size("4GiB"), help="test file size (default 4GiB)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--write-config", metavar="FILE", help="save the best settings as a config JSON file")
    parser.add_argument("--block-sizes", type=_size_list, default=_size_list("1MiB,8MiB"))
    parser.add_argument("--queue-depths", type=_int_list, default=[2, 8])
    parser.add_argument("--threads", type=_int_list, default=[1, 4])
    parser.add_argument("--backends", default="native,aiofiles", help="comma-separated: native, aiofiles")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds in the comparison (default 3)")
    parser.add_argument("--fio-engines", default="libaio,io_uring", help="fio ioengines to compare against")
    parser.add_argument("--no-fio", action="store_true", help="do not run fio even when it is on PATH")


def _check_settings(args: argparse.Namespace) -> None:
    """Each swept block size, queue depth and thread count through IOConfig's own bounds: the best
    of them becomes a config snippet, so one the config would refuse is no use measuring, and
    a huge queue depth would first try to allocate depth x block bytes of buffers."""
    for flag, values, field in (("--block-sizes", args.block_sizes, "block_size"),
                                ("--queue-depths", args.queue_depths, "queue_depth"),
                                ("--threads", args.threads, "threads")):
        for value in values:
            try:
                IOConfig(**{field: value})
            except ConfigError as exc:
                raise ValueError(f"{flag} {value}: {exc}") from None


def _check_write_config(path: str | None) -> None:
    """The --write-config target, before the benchmark rather than after it."""
    if path is None:
        return
    target = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(target) or not os.access(target, os.W_OK):
        raise ValueError(f"--write-config {path!r}: not a file in an existing writable directory")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"--write-config {path!r}: the file exists and is not writable")


def _check_args(args: argparse.Namespace) -> list[str]:
    if not os.path.isdir(args.path):
        raise ValueError(f"--path {args.path!r} is not an existing directory")
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in ("native", "aiofiles")]
    if bad or not backends:
        raise ValueError(f"--backends {args.backends!r}: expected native and/or aiofiles")
    _check_settings(args)
    if args.size < max(args.block_sizes):
        raise ValueError(f"--size {fmt_size(args.size)}: must hold one block of --block-sizes "
                         f"(the largest is {fmt_size(max(args.block_sizes))})")
    if args.size % ALIGN_BYTES:  # every pass is O_DIRECT, which refuses a transfer of part of a 4 KiB block
        raise ValueError(f"--size {fmt_size(args.size)}: must be a multiple of {ALIGN_BYTES} bytes "
                         "(O_DIRECT alignment)")
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: must be >= 1")
    _check_write_config(args.write_config)
    return backends


@contextlib.contextmanager
def scratch_file(directory: str, size: int) -> Iterator[str]:
    """A fully written test file in a private subdirectory, removed however the run ends."""
    work = os.path.join(os.path.abspath(directory), f"zero_offload-bench-io-{os.getpid()}")
    old = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so `kill` cleans up like Ctrl-C does
    try:
        os.mkdir(work, 0o700)
        path = os.path.join(work, "data.bin")
        _lay_out(path, size)
        yield path
    finally:
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, old)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _lay_out(path: str, size: int) -> None:
    """Write every block once: overwriting allocated blocks is what the swap store does, and what
    fio measures on an existing file (a first write into holes is slower on most filesystems)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    OurRunner("native" if _native_ok() else "aiofiles").run(Pattern("write", path, size, 8 << 20, 8, 1))


def _native_ok() -> bool:
    from zero_offload.io.native_aio import native_lib

    return native_lib() is not None


class Progress:
    """tqdm when installed, else one rewritten stderr line."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, unit="pass", file=sys.stderr, leave=False)
        except ImportError:
            self._bar, self._n, self._total = None, 0, total

    def step(self, label: str) -> None:
        if self._bar is not None:
            self._bar.set_description(label)
            self._bar.update(1)
            return
        self._n += 1
        print(f"\rbench-io {self._n}/{self._total} {label:<40}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


def sweep(path: str, args: argparse.Namespace, backends: Sequence[str], progress: Progress) -> list[dict]:
    """Phase 1: one write and one read pass per setting."""
    rows = []
    for kind, bs, qd, th in itertools.product(backends, args.block_sizes, args.queue_depths, args.threads):
        runner = OurRunner(kind)
        for op in OPS:
            rate = runner.run(Pattern(op, path, args.size, bs, qd, th))
            progress.step(f"sweep {kind} {op} {fmt_size(bs)} qd{qd} t{th}")
            rows.append({"op": op, "backend": kind, "block_size": bs, "queue_depth": qd, "threads": th,
                         "gbps": rate / 1e9})
    return rows


def best_setting(rows: list[dict]) -> tuple[str, dict]:
    """The backend and setting whose write and read rates have the highest geometric mean, over
    every backend swept (the config snippet names that backend, so it must be the fastest one)."""
    by_setting: dict[tuple, dict[str, float]] = {}
    for r in rows:
        key = (r["backend"], r["block_size"], r["queue_depth"], r["threads"])
        by_setting.setdefault(key, {})[r["op"]] = r["gbps"]
    best = max(by_setting, key=lambda k: (by_setting[k]["write"] * by_setting[k]["read"]) ** 0.5)
    return best[0], {"block_size": best[1], "queue_depth": best[2], "threads": best[3]}


def compare(path: str, size: int, setting: dict, runners: Sequence[Any], rounds: int,
            progress: Progress) -> dict[str, dict[str, list[float]]]:
    """Phase 2: every runner at one setting, interleaved round by round; GB/s per op per runner.
    A runner that fails (fio without an engine, say) is reported and dropped, not fatal."""
    rates: dict[str, dict[str, list[float]]] = {r.name: {op: [] for op in OPS} for r in runners}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for op, runner in itertools.product(OPS, runners):
            if runner.name not in errors:
                _run_one(runner, Pattern(op, path, size, **setting), rates, errors)
            progress.step(f"compare {runner.name} {op}")
    for name, why in errors.items():
        rates.pop(name, None)
        print(f"bench-io: {name} skipped: {why}", file=sys.stderr)
    return rates


def _run_one(runner: Any, p: Pattern, rates: dict, errors: dict) -> None:
    try:
        rates[runner.name][p.op].append(runner.run(p) / 1e9)
    except (RuntimeError, OSError, ValueError) as exc:
        errors[runner.name] = str(exc)


def is_ours(name: str) -> bool:
    return name.startswith(("native", "aiofiles"))


def summarize(rates: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Median, min and max per runner and op; for our runners also the ratio of their median to
    the best median among the reference engines (fio, ds_io)."""
    out: dict[str, Any] = {name: {op: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                                  for op, v in ops.items() if v} for name, ops in rates.items()}
    for op in OPS:
        best = max((out[n][op]["median"] for n in out if not is_ours(n) and op in out[n]), default=None)
        for n in out:
            if best and is_ours(n) and op in out[n]:
                out[n][op]["ratio_to_best_reference"] = out[n][op]["median"] / best
    return out


def print_comparison(summary: dict) -> None:
    """The interleaved comparison: one row per engine, then our/best-reference ratios."""
    print(f"{'engine':<14} {'write':>20} {'read':>20}")
    for name, ops in summary.items():
        cells = [f"{ops[op]['median']:.2f} ({ops[op]['min']:.2f}-{ops[op]['max']:.2f})" if op in ops else "-"
                 for op in OPS]
        print(f"{name:<14} {cells[0]:>20} {cells[1]:>20}")
    for name, ops in summary.items():
        ratios = [f"{op} {ops[op]['ratio_to_best_reference']:.0%}" for op in OPS
                  if "ratio_to_best_reference" in ops.get(op, {})]
        if ratios:
            print(f"{name} / best reference engine: {', '.join(ratios)}")


def config_snippet(setting: dict, backend: str) -> dict:
    return {"io": {**setting, "backend": backend, "direct": True}}


def print_report(args: argparse.Namespace, result: dict) -> None:
    """The sweep table, the comparison and the snippet: result["config"], the very one --json and
    --write-config save, so the printed and the saved settings cannot disagree."""
    rows, setting, summary = result["sweep"], result["best"], result["comparison"]
    print(f"zero-offload bench-io --path {args.path} --size {fmt_size(args.size)}  (sequential, O_DIRECT, GB/s = 1e9 B/s)")
    print(f"\n{'backend':<9} {'block':>6} {'qd':>3} {'thr':>3} {'write':>7} {'read':>7}")
    keyed: dict[tuple, dict] = {}
    for r in rows:
        keyed.setdefault((r["backend"], r["block_size"], r["queue_depth"], r["threads"]), {})[r["op"]] = r["gbps"]
    for (kind, bs, qd, th), v in keyed.items():
        print(f"{kind:<9} {fmt_size(bs):>6} {qd:>3} {th:>3} {v['write']:>7.2f} {v['read']:>7.2f}")
    print(f"\ncomparison at block {fmt_size(setting['block_size'])}, {setting['queue_depth'] * setting['threads']} "
          f"in flight, {args.rounds} interleaved rounds: median GB/s (min-max)")
    print_comparison(summary)
    print("\nbest settings (config snippet):")
    print(json.dumps(result["config"], indent=2))


def reference_runners(args: argparse.Namespace) -> list[Any]:
    if args.no_fio or not FioRunner.available():
        return []
    return [FioRunner(e) for e in args.fio_engines.split(",") if e]


def run(args: argparse.Namespace, extra_runners: Callable[[argparse.Namespace], list[Any]] = reference_runners) -> dict:
    """Both phases; returns everything the report shows. `extra_runners` adds reference engines."""
    backends = _check_args(args)
    refs = extra_runners(args)
    n_sweep = len(backends) * len(args.block_sizes) * len(args.queue_depths) * len(args.threads) * len(OPS)
    progress = Progress(n_sweep + args.rounds * len(OPS) * (len(backends) + len(refs) + 1))
    try:
        with scratch_file(args.path, args.size) as path:
            rows = sweep(path, args, backends, progress)
            backend, setting = best_setting(rows)
            # the checksummed runner goes last: its read verifies what its own write left
            runners = [OurRunner(k) for k in backends] + refs + [OurRunner(backend, checksums=True)]
            summary = summarize(compare(path, args.size, setting, runners, args.rounds, progress))
    finally:
        progress.close()
    return {"size": args.size, "sweep": rows, "best": setting, "comparison": summary,
            "config": config_snippet(setting, backend)}


def main(args: argparse.Namespace) -> int:
    try:
        result = run(args)
    except KeyboardInterrupt:
        print("bench-io: interrupted; test files removed", file=sys.stderr)
        return 130
    if args.write_config:
        with open(args.write_config, "w") as f:
            json.dump(result["config"], f, indent=2)
            f.write("\n")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(args, result)
    return 0
