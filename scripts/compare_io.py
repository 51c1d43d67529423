"""Our native async I/O against fio and DeepSpeed's libaio engine, interleaved, in one run.

This is the measurement behind docs/perf_io.md. DeepSpeed is never a dependency of zero_offload:
its engine runs in a separate interpreter (a venv with deepspeed and Debian's libaio-dev), driven
the way its `ds_io` tool drives it (`aio_handle.pwrite/pread` of one page-locked tensor the size
of the file, then `wait()`).

  python scripts/compare_io.py --path DIR [--size 4GiB] [--block-size 8MiB] [--queue-depth 8]
        [--threads 1] [--rounds 5] [--ds-python /tmp/dsvenv/bin/python]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zero_offload.bench import io as bench_io  # noqa: E402
from zero_offload.bench.io_runners import FioRunner, OurRunner, Pattern, drop_cache  # noqa: E402
from zero_offload.io.aio import open_backend  # noqa: E402
from zero_offload.io.buffers import aligned_empty  # noqa: E402

# Runs inside the DeepSpeed venv; prints bytes per second of one pass.
_DS_SCRIPT = """
import sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
op, path, size, bs, qd, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
h = AsyncIOBuilder().load(verbose=False).aio_handle(bs, qd, False, True, threads)
buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
buf.random_(0, 128)
start = time.perf_counter()
assert (h.pwrite if op == "write" else h.pread)(buf, path, False, True) != -1
h.wait()
print(size / (time.perf_counter() - start))
h.free_cpu_locked_tensor(buf)
"""


class WholeFileRunner:
    """Our native engine driven the way ds_io drives DeepSpeed's: one fresh buffer the size of the
    file on small pages, one request. It separates the engine from our buffer choice (huge pages)."""

    name = "native-1buf-4k"

    def run(self, p: Pattern) -> float:
        buf = aligned_empty(p.size, huge_pages=False).random_(0, 256)
        fd = os.open(p.path, os.O_RDWR | os.O_DIRECT)
        try:
            drop_cache(p.path)
            with open_backend("native", threads=p.threads, queue_depth=p.queue_depth, block_size=p.block_size) as io:
                start = time.perf_counter()
                (io.write if p.op == "write" else io.read)(fd, 0, buf, p.size).wait()
                return p.size / (time.perf_counter() - start)
        finally:
            os.close(fd)


class DsIoRunner:
    """DeepSpeed's aio_handle (libaio) in its own venv: threads = its intra-op parallelism."""

    name = "ds_io"

    def __init__(self, python: str) -> None:
        self.python = python

    def run(self, p: Pattern) -> float:
        drop_cache(p.path)
        cmd = [self.python, "-c", _DS_SCRIPT, p.op, p.path, str(p.size), str(p.block_size),
               str(p.queue_depth), str(p.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"ds_io failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
        return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True)
    ap.add_argument("--size", type=bench_io.parse_size, default=bench_io.parse_size("4GiB"))
    ap.add_argument("--block-size", type=bench_io.parse_size, default=bench_io.parse_size("8MiB"))
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ds-python", default="/tmp/dsvenv/bin/python")
    ap.add_argument("--fio-engines", default="libaio,io_uring")
    args = ap.parse_args()
    runners: list = [OurRunner("native"), OurRunner("native", huge_pages=False), WholeFileRunner(),
                     OurRunner("aiofiles")]
    if FioRunner.available():
        runners += [FioRunner(e) for e in args.fio_engines.split(",") if e]
    if os.path.exists(args.ds_python):
        runners.append(DsIoRunner(args.ds_python))
    runners.append(OurRunner("native", checksums=True))  # last: its read checks its own write
    setting = {"block_size": args.block_size, "queue_depth": args.queue_depth, "threads": args.threads}
    progress = bench_io.Progress(args.rounds * 2 * len(runners))
    try:
        with bench_io.scratch_file(args.path, args.size) as path:
            summary = bench_io.summarize(bench_io.compare(path, args.size, setting, runners, args.rounds, progress))
    except KeyboardInterrupt:
        print("compare_io: interrupted; test files removed", file=sys.stderr)
        return 130
    finally:
        progress.close()
    print(" ".join(["python scripts/compare_io.py"] + sys.argv[1:]))
    print(f"size {bench_io.fmt_size(args.size)}, block {bench_io.fmt_size(args.block_size)}, queue depth "
          f"{args.queue_depth} x {args.threads} threads, sequential O_DIRECT, {args.rounds} interleaved rounds; "
          "median GB/s (min-max), GB = 1e9 B")
    bench_io.print_comparison(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
