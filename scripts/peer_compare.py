#!/usr/bin/env python3
"""Time zero_offload beside DeepSpeed and a plain torch loop on the peer's model, interleaved.

The peer script (../shared/peer/ds_e2e.py) trains a 29.5M-parameter GPT under DeepSpeed ZeRO
offload on the CPU. This script builds the very same model class from that file, with the same
seeds and synthetic data, trains it under zero_offload, and runs the peer's configs in between
ours, round after round, so every ratio compares figures measured minutes apart on this noisy
machine. Each round starts one run later than the last, so no config always follows DeepSpeed's
heavy writes; our configs are also compared with the tuned one round by round. It never imports DeepSpeed itself: the peer runs in its own virtualenv (--ds-python).

    python scripts/peer_compare.py --ds-python /tmp/dsvenv/bin/python --rounds 2

Our configs, each beside the DeepSpeed config it is compared with:
  zo_stage2_cpu       stage 2, optimizer state and gradients on cpu (vs DeepSpeed zero2_cpu)
  zo_stage2_cpu_ds    the very DeepSpeed config zero2_cpu runs (ds_e2e.py's make_ds_config), read
                      by our DeepSpeed on-ramp: what a DeepSpeed user gets without tuning anything
  zo_stage3_nvme      stage 3, parameters and optimizer state on nvme, tuned: unit_modules
                      ["Block"] (vs zero3_nvme_maxcpu0)
  zo_stage3_nvme_default  zo_stage3_nvme without unit_modules: the default unit choice, the
                      only difference, so its ratio against zero3_nvme_maxcpu0 beside the tuned
                      one says what the default choice costs
  zo_stage3_nvme_ds   zero3_nvme_maxcpu0's own DeepSpeed config, read by our on-ramp: no
                      unit_modules (the default unit policy), its overlap_comm false (our
                      overlap_step), and our default staging budget, which holds this model's
                      optimizer state, so it reads less from the drive: the read MiB column shows it

The model and data sizes default to the peer's (--n-layer 8 --d-model 512 ...); smaller ones
(e.g. --only-ours --rounds 1 --warmup 1 --steps 1 --n-layer 2 --d-model 64 --seq 16 --vocab 256)
check the script end to end in seconds; only the peer's sizes compare with its figures.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

TAG = "PEER_COMPARE_RESULT "
# Each DeepSpeed config and ours against it: tuned, then its own config read by our on-ramp.
PAIRS = [("torch", ()), ("zero2_cpu", ("zo_stage2_cpu", "zo_stage2_cpu_ds")),
         ("zero3_nvme_maxcpu0", ("zo_stage3_nvme", "zo_stage3_nvme_default", "zo_stage3_nvme_ds"))]
SIZES = (("n_layer", 8), ("d_model", 512), ("n_head", 8), ("seq", 128), ("batch", 4), ("vocab", 8192))


def _default_peer_script() -> str:
    """../shared/peer/ds_e2e.py beside the repository (one level further up from a worktree)."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    candidates = [os.path.normpath(os.path.join(root, *up, "shared", "peer", "ds_e2e.py")) for up in (("..",), ("..", ".."))]
    return next((c for c in candidates if os.path.isfile(c)), candidates[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-script", default=_default_peer_script())
    p.add_argument("--ds-python", default="/tmp/dsvenv/bin/python", help="python of a venv with deepspeed")
    p.add_argument("--workdir", default=None, help="scratch dir on the drive under test (default: a temp dir)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--only-ours", action="store_true", help="skip the DeepSpeed runs")
    p.add_argument("--pairs", default=",".join(name for name, _ in PAIRS),
                   help="the DeepSpeed configs to run, each with ours beside it (comma-separated)")
    for name, default in SIZES:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                       help=f"model / data size, as ds_e2e.py's (default {default})")
    p.add_argument("--override", default="{}", help="JSON merged into our configs, e.g. '{\"overlap_step\": false}'")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    unknown = set(args.pairs.split(",")) - {name for name, _ in PAIRS}
    if unknown:
        p.error(f"--pairs: unknown {sorted(unknown)}; choose from {[name for name, _ in PAIRS]}")
    if any(getattr(args, n) < 1 for n, _ in SIZES) or args.d_model % args.n_head:
        p.error("the sizes must be >= 1 and --d-model a multiple of --n-head")
    if not os.path.isfile(args.peer_script):
        p.error(f"--peer-script {args.peer_script}: no such file")
    try:
        if not isinstance(json.loads(args.override), dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        p.error(f"--override: {e}")
    if not args.worker and not args.only_ours:
        ok = os.access(args.ds_python, os.X_OK) and subprocess.run(
            [args.ds_python, "-c", "import deepspeed"], capture_output=True).returncode == 0
        if not ok:
            p.error(f"--ds-python {args.ds_python}: not a python with deepspeed (or pass --only-ours)")
    return args


def _peer_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("ds_e2e_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(args: argparse.Namespace, peer: Any, nvme_dir: str) -> Any:
    from zero_offload import Config

    base = _ds_form(args, peer, nvme_dir) if args.worker.endswith("_ds") else _base_config(args.worker, nvme_dir)
    return Config.from_dict({**base.to_dict(), **json.loads(args.override)}) if args.override != "{}" else base


def _ds_form(args: argparse.Namespace, peer: Any, nvme_dir: str) -> Any:
    """The DeepSpeed config the peer runs for the paired DeepSpeed config (its make_ds_config, with
    its defaults and these sizes), given to our on-ramp as a DeepSpeed user would give it."""
    import warnings

    from zero_offload import Config, IgnoredDeepSpeedKeys

    ds_name = {"zo_stage2_cpu_ds": "zero2_cpu", "zo_stage3_nvme_ds": "zero3_nvme_maxcpu0"}[args.worker]
    peer_args = peer.parse_args(["--workdir", nvme_dir] + _size_argv(args))
    largest = max(max(args.vocab, args.seq) * args.d_model, 4 * args.d_model * args.d_model)  # as ds_e2e.py
    ds = peer.make_ds_config(peer_args, ds_name, nvme_dir, 1, largest)
    with warnings.catch_warnings():  # its logging and tuning keys: accepted without effect, as documented
        warnings.simplefilter("ignore", IgnoredDeepSpeedKeys)
        return Config.from_dict(ds)


def _base_config(name: str, nvme_dir: str) -> Any:
    from zero_offload import Config

    common = dict(optimizer={"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    if name == "zo_stage2_cpu":
        return Config(stage=2, tiers={"grads": "cpu", "optimizer": "cpu"}, **common)
    if name in ("zo_stage3_nvme", "zo_stage3_nvme_default"):
        # A staging budget well below the 354 MB of optimizer state, so that every step really
        # reads and writes it on the drive instead of finding it in the staging ring.
        units = {"stage3": {"unit_modules": ["Block"]}} if name == "zo_stage3_nvme" else {}
        return Config(stage=3, tiers={"params": "nvme", "grads": "cpu", "optimizer": "nvme"},
                      nvme_paths=(nvme_dir,), pinned_budget_bytes=64 << 20, **units, **common)
    raise SystemExit(f"unknown config {name}")


def _size_argv(args: argparse.Namespace) -> list[str]:
    return [a for n, _ in SIZES for a in ("--" + n.replace("_", "-"), str(getattr(args, n)))]


def _proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: argparse.Namespace) -> None:
    """One of our configs in this process, timed the way the peer times its own."""
    import torch

    import zero_offload

    peer = _peer_module(args.peer_script)
    torch.set_num_threads(os.cpu_count() or 1)
    GPT = peer.build_model_classes()
    g = torch.Generator().manual_seed(1234 + 1)
    shape = (args.batch, args.seq)
    data = [(torch.randint(0, args.vocab, shape, generator=g), torch.randint(0, args.vocab, shape, generator=g))
            for _ in range(args.warmup + args.steps)]
    torch.manual_seed(1234)
    model = GPT(vocab=args.vocab, seq=args.seq, d=args.d_model, n_layer=args.n_layer, n_head=args.n_head)
    model.init_weights()
    nparams = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.workdir) as nvme_dir:
        engine = zero_offload.initialize(model, _config(args, peer, nvme_dir))
        times: dict[str, list[float]] = {"fwd": [], "bwd": [], "step": [], "total": []}
        io0 = None
        for i, (x, y) in enumerate(data):
            if i == args.warmup:
                io0 = _proc_io()
            t0 = time.perf_counter()
            loss = engine(x, y)
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            for k, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("step", t3 - t2), ("total", t3 - t0)):
                times[k].append(v)
        io1 = _proc_io()
        del engine
    w, n = args.warmup, args.steps
    res = {"config": args.worker, "n_params": nparams,
           **{f"{k}_s_median": round(statistics.median(v[w:]), 4) for k, v in times.items()},
           "disk_read_mib_per_step": round((io1["read_bytes"] - io0["read_bytes"]) / n / 2**20, 1),
           "disk_write_mib_per_step": round((io1["write_bytes"] - io0["write_bytes"]) / n / 2**20, 1),
           "peak_rss_mib": round(_peak_rss_mib(), 1)}
    print(TAG + json.dumps(res), flush=True)


def _run(cmd: list[str], env: dict[str, str], tag: str) -> dict[str, Any]:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    raise RuntimeError(f"{' '.join(cmd[:4])} ... printed no result (exit {out.returncode}):\n{out.stderr[-3000:]}")


def run_peer(args: argparse.Namespace, name: str, workdir: str) -> dict[str, Any]:
    # DeepSpeed JIT-builds its CPU Adam and async I/O ops into TORCH_EXTENSIONS_DIR on first use.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MAX_JOBS": "2"}
    res = _run([args.ds_python, args.peer_script, "--workdir", workdir, "--config", name,
                "--warmup", str(args.warmup), "--steps", str(args.steps)] + _size_argv(args), env, "DS_E2E_RESULT ")
    return {"config": name, "total_s_median": res["step_s_median"], "fwd_s_median": res["fwd_s_median"],
            "bwd_s_median": res["bwd_s_median"], "step_s_median": res["opt_s_median"],
            "disk_read_mib_per_step": res.get("disk_read_mib_per_step"),
            "disk_write_mib_per_step": res.get("disk_write_mib_per_step"),
            "peak_rss_mib": res.get("peak_rss_mib_vmhwm")}


def run_ours(args: argparse.Namespace, name: str, workdir: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--peer-script", args.peer_script,
           "--workdir", workdir, "--warmup", str(args.warmup), "--steps", str(args.steps), "--override", args.override]
    return _run(cmd + _size_argv(args), dict(os.environ), TAG)


def orchestrate(args: argparse.Namespace) -> None:
    try:
        root = args.workdir or tempfile.mkdtemp(prefix="peer_compare_", dir="/work" if os.path.isdir("/work") else None)
        os.makedirs(root, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as e:
        raise SystemExit(f"peer_compare: --workdir {args.workdir}: {e.strerror}")
    try:
        _orchestrate(args, root)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"peer_compare: {e}")
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def _orchestrate(args: argparse.Namespace, root: str) -> None:
    results: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for peer_name, ours in [pair for pair in PAIRS if pair[0] in args.pairs.split(",")]:
            jobs = ([] if args.only_ours else [("ds", peer_name)]) + [("zo", name) for name in ours]
            for who, name in _rotated(jobs, r):
                os.sync()  # the last run's dirty pages are written back now, not billed to this one
                res = run_peer(args, name, root) if who == "ds" else run_ours(args, name, root)
                results.setdefault(name, []).append(res)
                print(f"round {r + 1}: {name:20} {res['total_s_median']:.3f} s/step", file=sys.stderr, flush=True)
    _print_paired(results)
    summary = {name: {k: statistics.median([x[k] for x in runs]) for k in runs[0] if k.endswith("_median")}
               | {k: statistics.median([x[k] or 0 for x in runs])
                  for k in ("disk_read_mib_per_step", "disk_write_mib_per_step")} | {
                  "peak_rss_mib": max(x["peak_rss_mib"] or 0 for x in runs)}
               for name, runs in results.items()}
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    _print_table(summary)


def _rotated(jobs: list[tuple[str, str]], r: int) -> list[tuple[str, str]]:
    """Round r starts one job later than round r - 1, so over len(jobs) rounds each config runs
    once in each position: whichever runs right after DeepSpeed's 560 MiB of writes a step no
    longer always the same one."""
    k = r % len(jobs) if jobs else 0
    return jobs[k:] + jobs[:k]


def _print_paired(results: dict[str, list[dict[str, Any]]]) -> None:
    """Each of our later configs against the first, round by round (minutes apart, so the
    machine's drift over the run cancels), and their median."""
    for _, ours in PAIRS:
        if not ours or ours[0] not in results:
            continue
        for name in ours[1:]:
            if name not in results:
                continue
            ratios = [x["total_s_median"] / t["total_s_median"] for x, t in zip(results[name], results[ours[0]])]
            print(f"{name} / {ours[0]} by round: {' '.join(f'{q:.3f}' for q in ratios)}; "
                  f"median {statistics.median(ratios):.3f}", file=sys.stderr, flush=True)


def _print_table(summary: dict[str, dict[str, Any]]) -> None:
    print(f"{'config':22}{'s/step':>9}{'fwd':>8}{'bwd':>8}{'step':>8}{'read MiB':>10}{'write MiB':>10}{'peak RSS':>10}")
    for name, s in summary.items():
        print(f"{name:22}{s['total_s_median']:9.3f}{s['fwd_s_median']:8.3f}{s['bwd_s_median']:8.3f}"
              f"{s['step_s_median']:8.3f}{s['disk_read_mib_per_step'] or 0:10.0f}"
              f"{s['disk_write_mib_per_step'] or 0:10.0f}{s['peak_rss_mib']:10.0f}")
    base = summary.get("torch", {}).get("total_s_median")
    for peer_name, ours in PAIRS:
        for name in ours:
            if name in summary and peer_name in summary:
                speedup = summary[peer_name]["total_s_median"] / summary[name]["total_s_median"]
                verdict = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
                print(f"{name} vs DeepSpeed {peer_name}: {verdict}")
        tuned = summary.get(ours[0], {}).get("total_s_median") if ours else None
        for name in ours[1:]:
            if name in summary and tuned:
                print(f"{name} vs {ours[0]}: {summary[name]['total_s_median'] / tuned:.3f}x its step time")
        for name in ours:
            if name in summary and base:
                print(f"{name} vs plain torch loop: {summary[name]['total_s_median'] / base:.2f}x the torch step time")


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
