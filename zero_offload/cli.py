"""`zero-offload`: info, estimate, config --check, and the benchmarks.

Benchmark subcommands live in their own modules (zero_offload/bench/) and are imported only
when run, so a broken benchmark never breaks `info` or `estimate`. Each such module provides
`add_arguments(parser)` and `main(args) -> int`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile
import warnings
from typing import Any, Callable, Iterator, Sequence

from zero_offload import ledger
from zero_offload.config import OPTIMIZERS, PRECISIONS, Config, ConfigError
from zero_offload.optim.registry import spec_for
from zero_offload.optim.spec import OptimizerSpec
from zero_offload.tiers import DEVICE, TIERS, tier

# name -> (module, one-line help)
_PLUGINS = {
    "bench-adam": ("zero_offload.bench.adam", "measure CPU Adam against torch and this machine's memory bandwidth"),
    "bench-io": ("zero_offload.bench.io", "measure a drive with our async I/O, aiofiles and fio"),
    "bench-step": ("zero_offload.bench.step", "time an offloaded training step and its overlap"),
}


class CLIError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:g} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}"
    return f"{n:.2f} TiB"


def cmd_info(args: argparse.Namespace) -> int:
    """What this installation can do: native library, CPU features, chosen kernels, torch."""
    import torch

    from zero_offload import native

    data = {"zero_offload": _version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "cpus": len(os.sched_getaffinity(0)), "native": native.info()}
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    nat = data["native"]
    print(f"zero_offload {data['zero_offload']}  torch {data['torch']}  cuda: {data['cuda']}  cpus: {data['cpus']}")
    print(f"native library: {'loaded from ' + str(nat['path']) if nat['loaded'] else 'NOT loaded: ' + str(nat['error'])}")
    feats = [k for k, v in nat["cpu_features"].items() if v]
    print(f"cpu features:   {' '.join(feats) or '(none of the dispatchable ones)'}")
    for key, value in nat.items():
        if isinstance(value, dict) and key != "cpu_features":
            print(f"{key + ':':15} " + ", ".join(f"{k}={v}" for k, v in value.items()))
    return 0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("zero_offload")
    except Exception:
        return "unknown"


def _one_line(exc: BaseException) -> str:
    """An exception as '<Type>: <first line>', for the CLI's one-line errors."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A parameter count as people write it: '7B', '1.5M', '350k', '100_000', '12' (decimal units,
    as model sizes are quoted)."""
    m = re.fullmatch(r"\s*(\d[\d_]*(?:\.\d+)?)\s*([a-zA-Z]?)\s*", text)
    if not m or m.group(2).lower() not in _COUNT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (examples: 12, 350k, 1.5M, 7B)")
    value = float(m.group(1).replace("_", "")) * _COUNT_SUFFIXES[m.group(2).lower()]
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters")
    return int(value)


_USER_MODULE = "_zo_user_model"  # the name a --model FILE.py is imported under


def _is_file_spec(mod_name: str) -> bool:
    return mod_name.endswith(".py") or os.sep in mod_name


@contextlib.contextmanager
def _import_root(mod_name: str) -> Iterator[None]:
    """Put where the user's code imports from first on sys.path, as Python would for
    `python FILE.py` (the file's folder, so it can import its siblings) or `python -m MODULE`
    (the working directory: the console script does not have it on sys.path). Kept while the
    builder runs too, since it may import lazily; removed after, so nothing leaks."""
    root = os.path.dirname(os.path.abspath(mod_name)) if _is_file_spec(mod_name) else os.getcwd()
    sys.path.insert(0, root)
    try:
        yield
    finally:
        if root in sys.path:
            sys.path.remove(root)


def _exec_file(spec: str, mod_name: str) -> Any:
    """Import a .py file as a module registered in sys.modules before it runs: the machinery
    that looks a module up by name while it executes (dataclasses with postponed annotations,
    pickling, typing) finds it there. It stays registered, as the builder still runs its code;
    a failed import is removed, as importlib does."""
    if not os.path.exists(mod_name):
        raise CLIError(f"--model: no such file {mod_name}")
    spec_obj = importlib.util.spec_from_file_location(_USER_MODULE, mod_name)
    if spec_obj is None or spec_obj.loader is None:
        raise CLIError(f"--model {spec!r}: {mod_name} is not a Python file")
    module = importlib.util.module_from_spec(spec_obj)
    sys.modules[_USER_MODULE] = module
    try:
        spec_obj.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(_USER_MODULE, None)
        raise
    return module


def _import_model_module(spec: str, mod_name: str) -> Any:
    """Import the user's module; anything it raises (ImportError, SyntaxError, an error at its
    top level) is the user's to fix, so it becomes one line naming the --model value."""
    try:
        if _is_file_spec(mod_name):
            return _exec_file(spec, mod_name)
        return importlib.import_module(mod_name)
    except CLIError:
        raise
    except Exception as exc:
        raise CLIError(f"--model {spec!r}: cannot import {mod_name}: {_one_line(exc)}") from None


def _split_spec(spec: str) -> tuple[str, str]:
    """'MODULE:CALLABLE' -> (MODULE, CALLABLE)."""
    if ":" not in spec:
        raise CLIError(f"--model {spec!r}: expected MODULE:CALLABLE (e.g. examples/models.py:gpt_small)")
    mod_name, attr = spec.rsplit(":", 1)
    return mod_name, attr


def load_callable(spec: str) -> Callable[[], Any]:
    """Resolve 'MODULE:CALLABLE' where MODULE is a dotted module or a .py file path; the
    caller holds _import_root when the module imports others (count_model_params does)."""
    mod_name, attr = _split_spec(spec)
    module = _import_model_module(spec, mod_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise CLIError(f"--model: {mod_name} has no callable {attr!r}")
    return fn


def count_model_params(spec: str) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of a model built on the meta device (no memory used).

    Tied parameters count once, as they are stored once.
    """
    import torch

    with _import_root(_split_spec(spec)[0]):
        fn = load_callable(spec)
        try:
            with torch.device("meta"):
                model = fn()
        except Exception as exc:  # e.g. a builder that needs arguments: the CLI calls it with none
            raise CLIError(f"--model {spec!r}: calling it with no arguments failed: {_one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"--model {spec}: returned {type(model).__name__}, not a torch.nn.Module")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen


def _estimate_rows(led: ledger.Ledger, spec: OptimizerSpec) -> list[str]:
    d = led.as_dict()
    tiers = [t for t in ledger.TIER_COLUMNS if d["per_rank_by_tier"][t]["total"] or tier(t).on_device]
    head = f"  {'state group':<22}" + "".join(f"{t + ' (per rank)':>20}" for t in tiers) + f"{'total':>16}"
    rows = [head]
    for g in ledger.GROUPS + ("total",):
        cells = "".join(f"{_fmt_bytes(d['per_rank_by_tier'][t][g]):>20}" for t in tiers)
        total = d["per_device"][g]
        label = {"weights": "weights", "gradients": "gradients",
                 "optimizer": f"optimizer ({'+'.join(spec.part_names)})"}.get(g, "total")
        rows.append(f"  {label:<22}{cells}{_fmt_bytes(total):>16}")
    rows.append(f"  machine ({led.ranks_per_node} ranks): host RAM {_fmt_bytes(d['machine']['cpu'])}, "
                f"NVMe {_fmt_bytes(d['machine']['nvme'])}")
    return rows


def _check_estimate_args(args: argparse.Namespace) -> None:
    """The flags alone, before any model is imported."""
    if (args.params is None) == (args.model is None):
        raise CLIError("estimate: give exactly one of --params N or --model MODULE:CALLABLE")
    if args.params is not None and args.params < 0:
        raise CLIError(f"--params {args.params}: must be >= 0")
    if args.dp < 1:
        raise CLIError(f"--dp {args.dp}: must be >= 1")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise CLIError(f"--ranks-per-node {args.ranks_per_node}: must be >= 1")
    if args.ranks_per_node is not None and args.ranks_per_node > args.dp:  # one machine holds some of the D ranks
        raise CLIError(f"--ranks-per-node {args.ranks_per_node}: must be <= --dp {args.dp}")


def _refusal(stage: int, tiers: dict[str, str], precision: str) -> str | None:
    """Why Config refuses this stage/tier/precision combination, or None: its own check
    (_check_combination, run when a Config is built), so estimate never shows a layout that
    training would refuse. An nvme tier gets a placeholder path, as that check wants one and
    estimate writes nothing."""
    paths = (tempfile.gettempdir(),) if any(tier(t).needs_nvme_paths for t in tiers.values()) else ()
    try:
        Config(stage=stage, tiers=tiers, precision={"dtype": precision}, nvme_paths=paths)
    except ConfigError as exc:
        return str(exc)
    return None


def _estimate_stages(args: argparse.Namespace, tiers: dict[str, str]) -> tuple[list[int], dict[int, str]]:
    """The stages to show and, for --stage all, those skipped with the reason; an error when
    no requested stage can run with these tiers."""
    if tier(tiers["params"]).off_device and args.stage not in ("all", "3"):
        raise CLIError(f"--params-tier {tiers['params']} needs --stage 3")
    requested = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    refused = {s: why for s in requested if (why := _refusal(s, tiers, args.precision)) is not None}
    if len(refused) == len(requested):
        flags = " ".join(f"--{g}-tier {t}" for g, t in tiers.items())
        raise CLIError(f"--stage {args.stage} {flags}: {refused[requested[-1]]}")
    return [s for s in requested if s not in refused], refused


def cmd_estimate(args: argparse.Namespace) -> int:
    """Ideal retained bytes per device, host and NVMe for each requested stage."""
    _check_estimate_args(args)
    tiers = {"params": args.params_tier, "grads": args.grads_tier, "optimizer": args.optimizer_tier}
    stages, refused = _estimate_stages(args, tiers)
    frozen = 0
    params = args.params
    if args.model:
        params, frozen = count_model_params(args.model)
    spec = spec_for(args.optimizer)
    results = {s: ledger.ideal(params, args.dp, s, args.precision, tiers, args.ranks_per_node, spec=spec)
               for s in stages}
    if args.json:
        print(json.dumps({"params": params, "frozen_params": frozen, "optimizer": args.optimizer,
                          "stages": {str(s): led.as_dict() for s, led in results.items()},
                          "refused": {str(s): why for s, why in refused.items()}}, indent=2))
        return 0
    per = ledger.bytes_per_param(args.precision, spec)
    what = "compute-dtype weights and grads" if args.precision != "fp32" else "fp32 compute copy, fp32 grads"
    conv = (f"{per['weights']}+{per['gradients']}+{per['optimizer']} bytes/param ({what}, "
            f"fp32 {'+'.join(spec.part_names)} for {args.optimizer})")
    print(f"P = {params:,} trainable parameters" + (f" (+{frozen:,} frozen, not counted)" if frozen else "")
          + f", D = {args.dp}, precision {args.precision}: {conv}")
    for s, why in refused.items():
        print(f"\nZeRO stage {s}: not shown, these tiers are refused there: {why}")
    for s, led in results.items():
        print(f"\nZeRO stage {s}: ideal retained bytes per rank = {_fmt_bytes(led.as_dict()['per_device']['total'])}")
        print("\n".join(_estimate_rows(led, spec)))
    print("\nIdeal retained state, not peak memory: it excludes " + ", ".join(ledger.EXCLUDED) + ".")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Validate a config file and print it normalized; DeepSpeed keys accepted without effect are
    one note line here, not Python's two-line warning pointing into runpy."""
    from zero_offload.deepspeed_compat import IgnoredDeepSpeedKeys

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", IgnoredDeepSpeedKeys)
        cfg = Config.from_file(args.check)
    for w in said:
        if issubclass(w.category, IgnoredDeepSpeedKeys):
            print(f"zero-offload: note: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    print(f"{args.check}: OK")
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-offload", description="ZeRO offload training for one workstation")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="what loaded: native library, CPU features, kernels")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("estimate", help="ideal bytes per GPU, host RAM and NVMe before training")
    p.add_argument("--params", type=parse_count, help="number of trainable parameters P (12, 350k, 1.5M, 7B)")
    p.add_argument("--model", help="MODULE:CALLABLE building the model (run on the meta device)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks D")
    p.add_argument("--ranks-per-node", type=int, default=None, help="ranks sharing one machine (default D)")
    p.add_argument("--stage", choices=["0", "1", "2", "3", "all"], default="all")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="the optimizer whose state bytes per parameter count (default adamw)")
    for group in ("params", "grads", "optimizer"):
        p.add_argument(f"--{group}-tier", choices=TIERS, default=DEVICE.name)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_estimate)
    p = sub.add_parser("config", help="validate a config file")
    p.add_argument("--check", required=True, metavar="FILE")
    p.set_defaults(func=cmd_config)
    for name, (module, help_text) in _PLUGINS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(func=None, plugin=module)
    return parser


def _run_plugin(module_name: str, argv: Sequence[str], name: str) -> int:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CLIError(f"{name} is not available in this installation: {exc}") from None
    parser = argparse.ArgumentParser(prog=f"zero-offload {name}")
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(list(argv))) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        if argv and argv[0] in _PLUGINS:
            rc = _run_plugin(_PLUGINS[argv[0]][0], argv[1:], argv[0])
        else:
            args = parser.parse_args(argv)
            rc = args.func(args)
        sys.stdout.flush()  # here, so a reader gone by now is a BrokenPipeError below, not at exit
        return rc
    except BrokenPipeError:
        return _reader_gone()
    except (CLIError, ConfigError, ValueError, OSError) as exc:
        print(f"zero-offload: error: {exc}", file=sys.stderr)
        return 2


def _reader_gone() -> int:
    """The reader of stdout closed it (`zero-offload estimate ... | head`): it has what it wanted,
    so no error message. stdout is pointed at /dev/null so the interpreter's flush at exit does
    not fail again on what is still buffered; 1, as Python's own docs do for EPIPE."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout with no file descriptor (a test's capture)
        pass
    return 1


if __name__ == "__main__":
    sys.exit(main())
