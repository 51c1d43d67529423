"""`zero-offload bench-io`: report, config snippet, and cleanup on every exit path."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_offload.bench import io as bench_io
from zero_offload.bench.io_runners import FioRunner
from zero_offload.config import Config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_io.add_arguments(parser)
    return parser.parse_args(argv)


def test_small_run_prints_table_ratios_and_a_loadable_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = tmp_path / "io.json"
    work = tmp_path / "drive"
    work.mkdir()
    args = _args(["--path", str(work), "--size", "8MiB", "--block-sizes", "1MiB", "--queue-depths", "2",
                  "--threads", "1,2", "--rounds", "1", "--fio-engines", "libaio", "--write-config", str(cfg)])
    assert bench_io.main(args) == 0
    out = capsys.readouterr().out
    assert "zero-offload bench-io --path" in out and "--size 8MiB" in out
    for kind in ("native", "aiofiles"):
        assert any(line.split()[:4] == [kind, "1MiB", "2", "1"] for line in out.splitlines()), out
    assert "comparison at block 1MiB" in out
    if FioRunner.available():
        assert "fio-libaio" in out and "native / best reference engine: write " in out
        assert "native+crc / best reference engine: write " in out
    io = Config.from_file(str(cfg)).io  # the snippet is a valid config
    assert io.block_size == 1 << 20 and io.queue_depth == 2 and io.threads in (1, 2)
    assert os.listdir(work) == []


def test_json_output_and_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = _args(["--path", str(tmp_path), "--size", "4MiB", "--block-sizes", "1MiB", "--queue-depths", "1",
                  "--threads", "1", "--rounds", "1", "--no-fio", "--backends", "aiofiles", "--json"])
    assert bench_io.main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["comparison"]) == {"aiofiles", "aiofiles+crc"} and data["config"]["io"]["backend"] == "aiofiles"
    assert data["comparison"]["aiofiles"]["read"]["median"] > 0
    with pytest.raises(ValueError, match="--path '/nonexistent' is not an existing directory"):
        bench_io.run(_args(["--path", "/nonexistent"]))
    with pytest.raises(ValueError, match="--backends 'spdk': expected native and/or aiofiles"):
        bench_io.run(_args(["--path", str(tmp_path), "--backends", "spdk"]))
    with pytest.raises(argparse.ArgumentTypeError, match="'4 parsecs' is not a size"):
        bench_io.parse_size("4 parsecs")
    assert os.listdir(tmp_path) == []


def test_ctrl_c_removes_the_test_files(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "zero_offload.cli", "bench-io", "--path", str(tmp_path), "--size", "64MiB",
           "--block-sizes", "1MiB", "--rounds", "100", "--no-fio"]
    # A shell's background job ignores SIGINT and children inherit that: restore the default so
    # the child installs Python's handler however pytest itself was started.
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(p.startswith("zero_offload-bench-io-") for p in os.listdir(tmp_path)):
            time.sleep(0.05)
        time.sleep(0.5)  # let it get into the measurements
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "bench-io: interrupted; test files removed" in err
    assert os.listdir(tmp_path) == []


def _rows(rates: dict[tuple[str, int], float]) -> list[dict]:
    """Sweep rows at queue depth 2, one thread: (backend, block size) -> write and read GB/s."""
    return [{"op": op, "backend": kind, "block_size": bs, "queue_depth": 2, "threads": 1, "gbps": gbps}
            for (kind, bs), gbps in rates.items() for op in bench_io.OPS]


def test_best_setting_is_the_best_over_every_backend() -> None:
    """It looked only at the first backend listed, so `--backends aiofiles,native` chose among
    aiofiles's settings however much faster native was."""
    rows = _rows({("aiofiles", 1 << 20): 1.0, ("aiofiles", 4 << 20): 2.0, ("native", 1 << 20): 3.0,
                  ("native", 4 << 20): 2.5})
    assert bench_io.best_setting(rows) == ("native", {"block_size": 1 << 20, "queue_depth": 2, "threads": 1})


def test_printed_snippet_is_the_one_saved(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The printed snippet named native whenever native ran, while --write-config and --json saved
    the first backend listed (here aiofiles), whichever was faster."""
    cfg = tmp_path / "io.json"
    work = tmp_path / "drive"
    work.mkdir()
    args = _args(["--path", str(work), "--size", "4MiB", "--block-sizes", "1MiB", "--queue-depths", "2",
                  "--threads", "1", "--rounds", "1", "--no-fio", "--backends", "aiofiles,native",
                  "--write-config", str(cfg)])
    assert bench_io.main(args) == 0
    out = capsys.readouterr().out
    printed = json.loads(out[out.index("best settings (config snippet):"):].split("\n", 1)[1])
    assert printed == json.loads(cfg.read_text())


def test_size_not_a_multiple_of_4096_is_refused_before_the_run(tmp_path: Path) -> None:
    """It failed on the first O_DIRECT write: "[Errno 22] write of ... failed: Invalid argument"."""
    with pytest.raises(ValueError, match=r"^--size 6000: must be a multiple of 4096 bytes \(O_DIRECT alignment\)$"):
        bench_io.run(_args(["--path", str(tmp_path), "--size", "6000", "--block-sizes", "4096", "--no-fio"]))
    assert os.listdir(tmp_path) == []
