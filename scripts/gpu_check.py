#!/usr/bin/env python
"""The engine on CUDA in under 5 minutes: equivalence with the AdamW reference, then overlap.

1. Stages 0-2 x optimizer tier (device, cpu, nvme) x fp32/bf16: 20 steps of the tests' TinyLM on
   the GPU against the single-process reference on the same GPU (same tolerances as the CPU tests),
   one stage-2 row with gradient_accumulation_steps=2, two rows with parameter groups (device and
   cpu tiers), two with a host optimizer, grads on the device and a deferred step (its held grad
   shards) whose weights are reloaded at step 3 (edits taken into the master), and fp16 with one
   poisoned step that must be skipped.
2. Stage 3 on a tiny model defined here (tied embedding/head, a frozen parameter, a block called
   twice, a checkpointed block; one unit per block): every allowed params tier x optimizer tier
   pair of device/cpu/nvme in fp32 (losses and weights within 1e-5 relative), three bf16 rows (the
   stages 0-2 bf16 tolerance: losses 3e-3 relative, every element 5 x lr absolute, see
   tests/test_engine_matrix.py), one row with gradient_accumulation_steps=2 and one with
   stage3.resident_bytes keeping the root unit resident, and one that rewrites every unit with
   engine.gathered(modify=True) at step 3. These run the updated shards written to
   the params tier from the step worker (Unit write/settle); each row also checks that the peak
   gathered bytes stayed within the live budget.
3. Overlap: a residual MLP stack on the GPU with the optimizer on pinned CPU (and on nvme): fwd+bwd
   alone, CPU Adam alone, the overlapped step and the serial step (overlap_step off), measured
   round-robin in one run. The overlapped step should be close to max(fwd+bwd, adam).

Every row runs even after one fails (device time is scarce), unless a CUDA error poisoned the
device: then the rest are listed as not run. Exit status 0 when every row passed, 1 otherwise, 2
when it cannot run (no CUDA, or the native library not built: `make native`). Run: python scripts/gpu_check.py [--nvme DIR]
CI: python scripts/gpu_check.py --cpu-dry-run runs the same rows on the CPU (CUDA hidden)
and the overlap code once at a tiny size without timing, so the script cannot rot unnoticed.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

if "--cpu-dry-run" in sys.argv[1:]:
    # Before torch first looks for CUDA: the engine computes on CUDA whenever it sees a GPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import zero_offload  # noqa: E402
from _engine_model import batch, make_model, reference_run  # noqa: E402
from _stage3_model import Block3  # noqa: E402  (one stage-3 unit; the model around it is below)
from test_engine_matrix import LR, TOL, compare  # noqa: E402

WD, ROWS = 0.01, 4
TIERS = ("device", "cpu", "nvme")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Check = Callable[[], None]  # raises when its row fails
Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Run:
    """Where the equivalence rows run and for how long."""

    device: str  # "cuda", or "cpu" for the dry run
    nvme: str  # directory for the nvme tier
    steps: int


# ---- running rows -------------------------------------------------------------------------------

def _fail_line(tag: str, exc: BaseException) -> str:
    """One line naming the row; a crash keeps its exception type, a mismatch only its message."""
    text = (str(exc).splitlines() or [""])[0]
    if not isinstance(exc, AssertionError):
        text = f"{type(exc).__name__}: {text}"
    return text if text.startswith(tag) else f"{tag}: {text}"


def _poisons_the_device(exc: BaseException) -> bool:
    """A CUDA error (an illegal access, a device-side assert) leaves the context unusable: every
    later row would fail the same way and hide which one broke it."""
    return "CUDA error" in str(exc) or type(exc).__name__ == "AcceleratorError"


def run_rows(rows: list[tuple[str, Check]]) -> list[str]:
    """Run every row, printing ok/FAIL as it goes: one broken row must not hide the others
    (except after a CUDA error, which ends the run: the rows left are listed as not run)."""
    failures = []
    for i, (tag, check) in enumerate(rows):
        t0 = time.perf_counter()
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - any crash is this row's failure
            failures.append(_fail_line(tag, exc))
            print(f"FAIL  {failures[-1]}", flush=True)
            if _poisons_the_device(exc):
                failures += [f"{t}: not run (a CUDA error in an earlier row)" for t, _ in rows[i + 1:]]
                print(f"STOP  a CUDA error: {len(rows) - i - 1} row(s) not run", flush=True)
                break
        else:
            print(f"ok    {tag}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return failures


def nvme_paths(run: Run, *tiers: str) -> list[str]:
    return [run.nvme] if "nvme" in tiers else []


def train(engine: zero_offload.engine.engine.Engine, batches: Batches, run: Run,
          micro: int, edit: Callable[[zero_offload.engine.engine.Engine], None] | None = None
          ) -> tuple[list[float], list[bool]]:
    """`run.steps` optimizer steps, each over `micro` equal micro-batches of the step's batch;
    returns the per-step mean losses (comparable with the reference's) and engine.step()'s results.
    `edit(engine)` runs before step 3 (an edit that keeps the values: it runs the code path that
    takes edited weights into the master, on the device)."""
    losses, applied = [], []
    for step in range(run.steps):
        if edit is not None and step == 3:
            edit(engine)
        x, y = batches(step)
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            loss = engine(xm.to(run.device), ym.to(run.device))
            engine.backward(loss)
            applied.append(engine.step())
            total += float(loss.detach())
        losses.append(total / micro)
    return losses, applied


def check_applied(applied: list[bool], micro: int, steps: int) -> None:
    """Only the last micro-batch of each accumulation cycle updates."""
    want = ([False] * (micro - 1) + [True]) * steps
    assert applied == want, f"engine.step() returned {applied}, expected {want}"


# ---- stages 0-2: the tests' TinyLM ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def tinylm_reference(steps: int, precision: str, device: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Computed once per precision: every stage 0-2 row compares with the same run."""
    return reference_run(steps, ROWS, DTYPES[precision], lr=LR, wd=WD, device=device)


def _reload_own_weights(engine: zero_offload.engine.engine.Engine) -> None:
    """Stages 0-2: the module's own values loaded back (versions bumped, values kept)."""
    engine.module.load_state_dict(engine.module.state_dict())


def _rewrite_gathered(engine: zero_offload.engine.engine.Engine) -> None:
    """Stage 3: every unit gathered and written back unchanged (engine.gathered(modify=True))."""
    with engine.gathered(modify=True):
        pass


def stage012_row(tag: str, run: Run, stage: int, tier: str, precision: str, micro: int = 1,
                 grads: str | None = None, **extra: Any) -> None:
    """`grads` another grads tier than the optimizer's; `extra` more config (clip_grad_norm=1e9
    defers the step without clipping anything, so the reference still holds)."""
    cfg = dict(stage=stage, precision={"dtype": precision}, bucket_bytes=6000, pinned_budget_bytes=100_000,
               tiers={"optimizer": tier, "grads": grads or tier}, optimizer={"lr": LR, "weight_decay": WD},
               gradient_accumulation_steps=micro, nvme_paths=nvme_paths(run, tier, grads or tier), **extra)
    engine = zero_offload.initialize(make_model(), cfg)
    try:
        edit = _reload_own_weights if grads is not None else None
        losses, applied = train(engine, lambda step: batch(step, ROWS), run, micro, edit)
        weights = engine.consolidated_state_dict()
    finally:
        engine.close()
    check_applied(applied, micro, run.steps)
    compare(tag, losses, weights, *tinylm_reference(run.steps, precision, run.device), TOL[precision])


def param_groups_row(tag: str, run: Run, stage: int, tier: str) -> None:
    """Two parameter groups (tests/test_param_groups.py's: other lr, betas and weight decay for
    biases, norms and some matrices); 20 kB buckets hold both, so each kernel call covers a run
    of one group (on the device tier: torch's fused AdamW on slices of a shard)."""
    from test_param_groups import HYPER, _group, engine_groups

    cfg = dict(stage=stage, bucket_bytes=20000, pinned_budget_bytes=100_000, tiers={"optimizer": tier, "grads": tier},
               optimizer={"lr": LR, "weight_decay": WD}, nvme_paths=nvme_paths(run, tier))
    model = make_model()
    engine = zero_offload.initialize(model, cfg, param_groups=engine_groups(model))
    try:
        losses, _ = train(engine, lambda step: batch(step, ROWS), run, 1)
        weights = engine.consolidated_state_dict()
    finally:
        engine.close()
    ref = reference_run(run.steps, ROWS, torch.float32, lr=LR, wd=WD, device=run.device, groups=(_group, HYPER))
    compare(tag, losses, weights, *ref, TOL["fp32"])


def fp16_skip(run: Run) -> None:
    """An infinite loss at step 2 must skip exactly that update."""
    engine = zero_offload.initialize(make_model(), dict(stage=2, precision={"dtype": "fp16", "initial_scale_power": 8},
                                                        tiers={"optimizer": "cpu", "grads": "cpu"}))
    applied = []
    try:
        for step in range(5):
            x, y = batch(step, ROWS)
            loss = engine(x.to(run.device), y.to(run.device))
            engine.backward(loss * math.inf if step == 2 else loss)
            applied.append(engine.step())
    finally:
        engine.close()
    assert applied == [True, True, False, True, True] and engine.skipped_steps == 1, (
        f"applied {applied}, skipped_steps {engine.skipped_steps}")


def fp16_skip_in_a_group(run: Run) -> None:
    """The same inside a one-rank process group (NCCL on CUDA, gloo on the dry run): the loss
    scaler's norm and the step's failure flag are host scalars, which a NCCL-only group moves
    only through the device (comm.all_reduce_)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl" if run.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        fp16_skip(run)
    finally:
        dist.destroy_process_group()


def stage012_rows(run: Run) -> list[tuple[str, Check]]:
    rows = []
    for precision in ("fp32", "bf16"):
        for stage in (0, 1, 2):
            for tier in TIERS:
                tag = f"{run.device} stage={stage} tier={tier} {precision}"
                rows.append((tag, functools.partial(stage012_row, tag, run, stage, tier, precision)))
    tag = f"{run.device} stage=2 tier=cpu fp32 gradient_accumulation_steps=2"
    rows.append((tag, functools.partial(stage012_row, tag, run, 2, "cpu", "fp32", 2)))
    for tier in ("cpu", "nvme"):  # held grad shards of a host optimizer with grads on the device; an edit
        tag = f"{run.device} stage=2 optimizer={tier} grads=device fp32 deferred step, weights reloaded at step 3"
        rows.append((tag, functools.partial(stage012_row, tag, run, 2, tier, "fp32", grads="device",
                                            clip_grad_norm=1e9)))
    for tier in ("device", "cpu"):
        tag = f"{run.device} stage=1 tier={tier} fp32 two parameter groups"
        rows.append((tag, functools.partial(param_groups_row, tag, run, 1, tier)))
    rows.append((f"{run.device} fp16 overflow skips exactly one step", functools.partial(fp16_skip, run)))
    group = "nccl" if run.device == "cuda" else "gloo"
    rows.append((f"{run.device} fp16 overflow skips exactly one step, in a one-rank {group} group",
                 functools.partial(fp16_skip_in_a_group, run)))
    return rows


# ---- stage 3: a tiny model defined here ----------------------------------------------------------

S3_VOCAB, S3_D, S3_SEQ = 48, 24, 8
S3_BUDGET = 30000  # bytes: the root unit (~5.6 kB in fp32) plus about two blocks (~9.7 kB each)
S3_RESIDENT = 8000  # bytes: above the root unit, below a block, so exactly the root unit is resident


class S3Model(nn.Module):
    """What stage 3 must handle, each once: a head tied to the root unit's embedding, a frozen
    parameter (a sharded group without a master), a block called twice in one forward and a block
    under non-reentrant checkpointing (gathered again inside backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(S3_VOCAB, S3_D)
        self.pos = nn.Parameter(torch.randn(S3_SEQ, S3_D) * 0.02)
        self.frozen_gain = nn.Parameter(torch.rand(S3_D) + 0.5, requires_grad=False)
        self.blocks = nn.ModuleList(Block3(S3_D) for _ in range(3))
        self.ln_f = nn.LayerNorm(S3_D)
        self.head = nn.Linear(S3_D, S3_VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        x = self.blocks[0](self.blocks[0](x))
        x = self.blocks[2](checkpoint(self.blocks[1], x, use_reentrant=False))
        logits = self.head(self.ln_f(x) * self.frozen_gain)
        return F.cross_entropy(logits.float().view(-1, S3_VOCAB), targets.reshape(-1))


def s3_model(dtype: torch.dtype) -> S3Model:
    """Seeded, and already in the compute dtype (as a user hands a bf16 model to stage 3)."""
    torch.manual_seed(0)
    return S3Model().to(dtype)


def s3_batch(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, S3_VOCAB, (rows, S3_SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


@functools.lru_cache(maxsize=None)
def s3_reference(steps: int, precision: str, device: str,
                 lr: float = LR) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch.optim.AdamW on the whole batch; for bf16 the mixed-precision loop (bf16 model, fp32
    masters stepped and copied back). Returns the losses and the fp32 trainable weights."""
    model = s3_model(DTYPES[precision]).to(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for _, p in named]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=WD)
    losses = []
    for step in range(steps):
        x, y = s3_batch(step)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        losses.append(float(loss.detach()))
        for (_, p), m in zip(named, masters):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for (_, p), m in zip(named, masters):
                p.copy_(m)
    return losses, {n: m.detach().cpu() for (n, _), m in zip(named, masters)}


def s3_config(run: Run, params: str, opt: str, precision: str, micro: int, resident: int) -> dict:
    return dict(stage=3, precision={"dtype": precision}, tiers={"params": params, "optimizer": opt, "grads": opt},
                stage3={"unit_modules": ["Block3"], "live_budget_bytes": S3_BUDGET, "prefetch_depth": 2,
                        "resident_bytes": resident},
                optimizer={"lr": LR, "weight_decay": WD}, gradient_accumulation_steps=micro,
                pinned_budget_bytes=100_000, nvme_paths=nvme_paths(run, params, opt))


def stage3_row(tag: str, run: Run, params: str, opt: str, precision: str, micro: int = 1, resident: int = 0,
               gathered: bool = False) -> None:
    cfg = s3_config(run, params, opt, precision, micro, resident)
    engine = zero_offload.initialize(s3_model(DTYPES[precision]), cfg)
    try:
        losses, applied = train(engine, s3_batch, run, micro, _rewrite_gathered if gathered else None)
        weights = engine.consolidated_state_dict()
        stats, units = engine.runtime.stats(), sum(u.nbytes for u in engine.runtime.units)
    finally:
        engine.close()
    check_applied(applied, micro, run.steps)
    assert 0 < stats["peak_gathered_bytes"] <= S3_BUDGET, f"peak gathered bytes outside (0, live budget]: {stats}"
    assert (0 < stats["resident_bytes"] < units) if resident else stats["resident_bytes"] == 0, (
        f"resident bytes {stats['resident_bytes']} of {units} with stage3.resident_bytes={resident}")
    compare(tag, losses, weights, *s3_reference(run.steps, precision, run.device), TOL[precision])


def stage3_grid() -> list[tuple[str, str, str]]:
    """(params, optimizer, precision): parameters off the device need the optimizer off it too."""
    pairs = [(p, o) for p in TIERS for o in TIERS if p == "device" or o != "device"]
    bf16 = [("device", "device"), ("cpu", "cpu"), ("nvme", "nvme")]
    return [(p, o, "fp32") for p, o in pairs] + [(p, o, "bf16") for p, o in bf16]


def stage3_rows(run: Run) -> list[tuple[str, Check]]:
    rows = []
    for params, opt, precision in stage3_grid():
        tag = f"{run.device} stage=3 params={params} optimizer={opt} {precision}"
        rows.append((tag, functools.partial(stage3_row, tag, run, params, opt, precision)))
    tag = f"{run.device} stage=3 params=cpu optimizer=cpu fp32 gradient_accumulation_steps=2"
    rows.append((tag, functools.partial(stage3_row, tag, run, "cpu", "cpu", "fp32", micro=2)))
    tag = f"{run.device} stage=3 params=nvme optimizer=cpu fp32 resident_bytes={S3_RESIDENT}"
    rows.append((tag, functools.partial(stage3_row, tag, run, "nvme", "cpu", "fp32", resident=S3_RESIDENT)))
    tag = f"{run.device} stage=3 params=cpu optimizer=cpu fp32 engine.gathered(modify=True) at step 3"
    rows.append((tag, functools.partial(stage3_row, tag, run, "cpu", "cpu", "fp32", gathered=True,
                                        resident=S3_RESIDENT)))
    return rows


# ---- overlap benchmark -----------------------------------------------------------------------------

def _mlp(d: int, layers: int) -> torch.nn.Module:
    from zero_offload.bench.step import _model

    return _model(d, layers)


def _timed(fn: Callable[[], None], rounds: int, device: str) -> list[float]:
    """Wall time per call; on CUDA synchronized so queued kernels count."""
    out = []
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def _overlap_engines(nvme: str, d: int, layers: int) -> dict[str, zero_offload.engine.engine.Engine]:
    engines = {}
    for name, tier, ov in (("step (cpu, overlapped)", "cpu", True), ("step (cpu, serial)", "cpu", False),
                           ("step (nvme, overlapped)", "nvme", True)):
        path = os.path.join(nvme, "overlap")
        cfg = dict(stage=1, precision={"dtype": "bf16"}, tiers={"optimizer": tier, "grads": "cpu"}, overlap_step=ov,
                   bucket_bytes=32 << 20, nvme_paths=[path] if tier == "nvme" else [])
        os.makedirs(path, exist_ok=True)
        engines[name] = zero_offload.initialize(_mlp(d, layers), cfg)
    return engines


def _adam_only(engine: zero_offload.engine.engine.Engine) -> Callable[[], None]:
    """The host Adam over the same shard sizes as the engine's buckets, with nothing else running."""
    from zero_offload.engine.step.pipeline import HostAdam, Scalars

    adam, s = HostAdam(0), Scalars(1, 1e-4, 0.9, 0.999, 1e-8, 0.01, True)
    shards = [(torch.randn(n), torch.randn(n, dtype=torch.bfloat16), torch.zeros(n), torch.zeros(n),
               torch.empty(n, dtype=torch.bfloat16))
              for n in (b.layout.shard_numel for b in engine.runtime.buckets)]

    def run() -> None:
        for p, g, m, v, out in shards:
            adam(p, g, m, v, s, out)
    return run


def _engine_step(e: zero_offload.engine.engine.Engine, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        e.backward(e(x).float().pow(2).mean())
        e.step()
    return run


def overlap(nvme: str, d: int, layers: int, tokens: int, rounds: int, device: str) -> None:
    """Median times of the parts and the steps, measured round-robin so drift hits all alike."""
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    plain = _mlp(d, layers).to(device).bfloat16()
    params = sum(p.numel() for p in plain.parameters())

    def fwd_bwd() -> None:
        plain(x).float().pow(2).mean().backward()
        plain.zero_grad(set_to_none=True)

    engines = _overlap_engines(nvme, d, layers)
    try:
        parts = {"fwd+bwd (gpu)": fwd_bwd, "cpu adam": _adam_only(next(iter(engines.values()))),
                 **{k: _engine_step(e, x) for k, e in engines.items()}}
        for fn in parts.values():
            _timed(fn, 1, device)
        times: dict[str, list[float]] = {k: [] for k in parts}
        for _ in range(rounds):
            for k, fn in parts.items():
                times[k] += _timed(fn, 1, device)
    finally:
        for e in engines.values():
            e.close()
    _report_overlap({k: statistics.median(v) for k, v in times.items()}, params, tokens, rounds, device)


def _report_overlap(med: dict[str, float], params: int, tokens: int, rounds: int, device: str) -> None:
    smoke = "" if device == "cuda" else " (CPU smoke run: the times mean nothing)"
    print(f"\noverlap benchmark: {params / 1e6:.1f}M parameters, bf16, {tokens} rows; median of {rounds} rounds{smoke}")
    for k, v in med.items():
        print(f"  {k:26} {v * 1e3:9.1f} ms")
    largest = max(med["fwd+bwd (gpu)"], med["cpu adam"])
    print(f"  overlapped cpu step / max(fwd+bwd, adam) = {med['step (cpu, overlapped)'] / largest:.2f}x; "
          f"serial = {med['step (cpu, serial)'] / largest:.2f}x")


# ---- main -------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme", default=None, help="directory for the nvme tier (default: a temp dir)")
    parser.add_argument("--d-model", type=int, default=2048,
                        help="overlap benchmark width (default 2048: ~270M parameters, inside the 5 minutes)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per equivalence row (default 20)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the equivalence rows on the CPU with CUDA hidden; skip the CUDA timing")
    return parser.parse_args(argv)


def all_rows(run: Run, args: argparse.Namespace) -> list[tuple[str, Check]]:
    """Equivalence rows, then the overlap benchmark (a failed row only if it crashes)."""
    if run.device == "cuda":
        bench = functools.partial(overlap, run.nvme, args.d_model, args.layers, args.tokens, 5, "cuda")
    else:  # the same code once at a tiny size, only so that it cannot rot; its times mean nothing
        bench = functools.partial(overlap, run.nvme, 64, 2, 32, 1, "cpu")
    return stage012_rows(run) + stage3_rows(run) + [(f"{run.device} overlap benchmark", bench)]


def _native_loaded() -> bool:
    """Without the native library the CPU Adam and the I/O fall back to torch and Python: the
    rows would pass and the overlap figures would mean nothing. Build it first (make native)."""
    from zero_offload import native

    info = native.info()
    adam = info.get("cpu_adam", {})
    print(f"native: loaded={info['loaded']} path={info['path']} cpu adam isa={adam.get('isa')} "
          f"aio={info.get('aio', {}).get('auto_backend')}", flush=True)
    if not info["loaded"]:
        print(f"gpu_check: the native library did not load ({info['error']}); run `make native` first",
              file=sys.stderr)
    return bool(info["loaded"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_dry_run and torch.cuda.is_available():
        print("gpu_check: --cpu-dry-run could not hide CUDA (set CUDA_VISIBLE_DEVICES= )", file=sys.stderr)
        return 2
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; this script checks the CUDA paths (--cpu-dry-run runs them on the CPU)",
              file=sys.stderr)
        return 2
    if args.cpu_dry_run:
        print("gpu_check --cpu-dry-run: equivalence rows on the CPU; SKIPPED: CUDA synchronize timing, the "
              "overlap ratios (the benchmark runs once at d=64 as a smoke test) and pinned host memory")
    if not _native_loaded():
        return 2
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=args.nvme) as nvme:
        run = Run("cpu" if args.cpu_dry_run else "cuda", nvme, args.steps)
        failures = run_rows(all_rows(run, args))
    print(f"\ngpu_check: {len(failures)} failure(s) in {time.time() - t0:.0f} s")
    for line in failures:
        print(f"  {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
