"""Parameters without a gradient are not stepped, as torch.optim.AdamW skips a .grad of None.

`Branchy` has a branch used only in some steps (by every rank, by rank 0 only, or by none) and a
parameter that never gets a gradient. Against torch.optim.AdamW on the same global batch: fp32
weights within 1e-5 relative (L2 per parameter), and in every precision the parameter without a
gradient bit for bit as initialized with zero moments, and each parameter's own step count
(`ShardOptimizer.lagging`) what AdamW's state['step'] says. Stages 0-3, tiers device/cpu/nvme,
D = 1 here and D = 2 in one spawned job, accumulation, clipping, the serial step, fp16 and bf16,
sub-shards, parameter groups, and checkpoints (bit-exact resume, another bucketing).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from _dist import run_ranks

WIDTH, ROWS, STEPS, LR, WD = 48, 2, 6, 1e-2, 0.1
LOW_TOL = 5 * LR  # bf16/fp16: element abs (see test_engine_matrix's docstring), the semantics checked exactly


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.branch = nn.Linear(WIDTH, WIDTH)
        self.never = nn.Parameter(torch.randn(40))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x.to(self.trunk.weight.dtype)))
        if use:
            h = h + torch.tanh(self.branch(h))
        return F.mse_loss(self.head(h).float(), y)


def make_model() -> Branchy:
    torch.manual_seed(0)
    return Branchy()


def uses(micro_batch: int, rank: int, one_rank: bool = True) -> bool:
    """Whether `rank` runs the branch in this (global) micro-batch: every rank at 1 and 4 (mod 8),
    rank 0 alone at 3 (or nobody, without `one_rank`), nobody otherwise."""
    i = micro_batch % 8
    return i in (1, 4) or (i == 3 and rank == 0 and one_rank)


def data(micro_batch: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + micro_batch)
    return torch.randn(ROWS * world, WIDTH, generator=g), torch.randn(ROWS * world, 4, generator=g)


def groups_of(names: list[str]) -> list[dict]:
    return [{"params": [n for n in names if n.endswith("weight")], "weight_decay": WD},
            {"params": [n for n in names if not n.endswith("weight")], "weight_decay": 0.0, "lr": 2 * LR}]


def reference(steps: int, world: int, *, micro: int = 1, clip: float = 0.0, groups: bool = False,
              dtype: torch.dtype = torch.float32, one_rank: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """torch.optim.AdamW on the mean of every rank's loss (its rows, its use of the branch): the
    final fp32 weights and each parameter's state['step']."""
    model = make_model().to(dtype)
    named = list(model.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in named}
    spec = groups_of([n for n, _ in named]) if groups else [{"params": [n for n, _ in named]}]
    opt = torch.optim.AdamW([{**g, "params": [masters[n] for n in g["params"]]} for g in spec], lr=LR, weight_decay=WD)
    for step in range(steps):
        for k in range(micro):
            x, y = data(step * micro + k, world)
            for r in range(world):
                rows = slice(r * ROWS, (r + 1) * ROWS)
                (model(x[rows], y[rows], uses(step * micro + k, r, one_rank)) / (world * micro)).backward()
        for n, p in named:
            masters[n].grad, p.grad = (None if p.grad is None else p.grad.float()), None
        if clip:
            torch.nn.utils.clip_grad_norm_(list(masters.values()), clip)
        opt.step()
        with torch.no_grad():
            for n, p in named:
                p.copy_(masters[n])
    counts = {n: int(opt.state[m]["step"]) if m in opt.state else 0 for n, m in masters.items()}
    return {n: m.detach() for n, m in masters.items()}, counts


def config(stage: int, tier: str, nvme_dir: str, **extra: Any) -> dict:
    cfg = dict(stage=stage, tiers={"optimizer": tier, "grads": tier}, optimizer={"lr": LR, "weight_decay": WD},
               bucket_bytes=6000, nvme_paths=[nvme_dir] if tier == "nvme" else [])
    if stage == 3:
        cfg["tiers"]["params"] = "device" if tier == "device" else "cpu"
        cfg["stage3"] = {"unit_modules": ["Linear"]}
    return {**cfg, **extra}


def engine_for(cfg: dict, groups: bool = False) -> Any:
    import zero_offload

    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    return zero_offload.initialize(model, cfg, param_groups=groups_of(names) if groups else None)


def train(engine: Any, steps: range, world: int, rank: int, *, micro: int = 1, one_rank: bool = True) -> None:
    for step in steps:
        for k in range(micro):
            x, y = data(step * micro + k, world)
            rows = slice(rank * ROWS, (rank + 1) * ROWS)
            engine.backward(engine(x[rows], y[rows], uses(step * micro + k, rank, one_rank)))
            engine.step()


def check(tag: str, engine: Any, want: dict[str, torch.Tensor], counts: dict[str, int], low: bool = False) -> None:
    """Weights against the reference (collective: consolidated_state_dict), the parameter without
    a gradient exactly as initialized with zero moments, and each piece's step count."""
    from zero_offload import comm

    got = engine.consolidated_state_dict()
    if comm.rank() == 0:  # the weights are rank 0's
        _check_weights(tag, engine, got, want, low)
    check_counts(tag, engine, counts)


def _check_weights(tag: str, engine: Any, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   low: bool) -> None:
    initial = make_model().never.detach()
    if engine.config.stage < 3:  # stages 0-2 take the model in the compute dtype; stage 3 masters are fp32
        initial = initial.to(engine.dtype).float()
    assert torch.equal(got["never"], initial), f"{tag}: the parameter without a gradient moved"
    for name, ref in want.items():
        if low:
            err = float((got[name].float() - ref).abs().max())
            assert err <= LOW_TOL, f"{tag}: {name} abs err {err:.2e} (tol {LOW_TOL})"
        else:
            err = float((got[name].float() - ref).norm() / ref.norm())
            assert err <= 1e-5, f"{tag}: {name} rel err {err:.2e} (tol 1e-5)"


def check_counts(tag: str, engine: Any, counts: dict[str, int]) -> None:
    """Every piece of every parameter this rank holds at its own step count; `never`'s moments zero."""
    rt = engine.runtime
    so, pieces = rt.shard_optimizer, rt.shard_map()
    lagging = so.lagging(pieces)
    for key, plist in pieces.items():
        steps = min(so.sub_steps[sub.key] for sub in so.subshards[key])
        state = so.read_state(key)
        for name, poff, soff, n in plist:
            runs = [r for r in lagging.get(name, []) if r[0] < poff + n and poff < r[0] + r[1]]
            seen = {r[2] for r in runs} | ({steps} if sum(r[1] for r in runs) < n else set())
            assert seen == {counts[name]}, f"{tag}: {name}[{poff}:{poff + n}] at step counts {seen}, AdamW {counts[name]}"
            if name == "never":
                assert not state["m"][soff:soff + n].any() and not state["v"][soff:soff + n].any(), tag


# ---- D = 1, in this process ----

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_without_a_gradient_is_not_stepped(stage: int, tmp_path: Any) -> None:
    """The old engine stepped them with a zero gradient: `never` weight-decayed, the branch moved
    by its moments in the steps it was not used and bias-corrected with the global count."""
    want, counts = reference(STEPS, 1)
    assert counts["never"] == 0 and 0 < counts["branch.weight"] < STEPS
    for tier in ("device", "cpu", "nvme"):
        engine = engine_for(config(stage, tier, str(tmp_path)))
        train(engine, range(STEPS), 1, 0)
        check(f"stage {stage} {tier}", engine, want, counts)
        engine.close()


VARIANTS = {  # name: [(stage, tier), ...]
    "accumulation": [(2, "cpu"), (3, "nvme")],
    "clipping": [(0, "device"), (3, "cpu")],
    "serial step": [(1, "nvme")],
    "bf16": [(2, "cpu"), (3, "cpu")],
    "fp16": [(1, "cpu")],
    "sub-shards": [(1, "nvme"), (3, "nvme")],
    "param groups": [(2, "device"), (3, "cpu")],
}


def _variant(name: str) -> tuple[dict, dict]:
    """(config extras, reference extras) of a variant."""
    return {"accumulation": ({"gradient_accumulation_steps": 2}, {"micro": 2}),
            "clipping": ({"clip_grad_norm": 0.05}, {"clip": 0.05}),
            "serial step": ({"overlap_step": False}, {}),
            "bf16": ({"precision": {"dtype": "bf16"}}, {"dtype": torch.bfloat16}),
            "fp16": ({"precision": {"dtype": "fp16", "static_scale": 256.0}}, {"dtype": torch.float16}),
            # one bucket of every parameter, stepped in 1024-element sub-shards (a weight spans several)
            "sub-shards": ({"bucket_bytes": 1 << 20, "pinned_budget_bytes": 36 * 1024}, {}),
            "param groups": ({}, {"groups": True})}[name]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_skip_what_has_no_gradient(name: str, tmp_path: Any) -> None:
    extra, ref_extra = _variant(name)
    want, counts = reference(STEPS, 1, **ref_extra)
    low = "dtype" in ref_extra
    for stage, tier in VARIANTS[name]:
        engine = engine_for(config(stage, tier, str(tmp_path), **extra), groups=ref_extra.get("groups", False))
        if name == "sub-shards":
            assert any(len(s) > 1 for s in engine.runtime.shard_optimizer.subshards.values())
        train(engine, range(STEPS), 1, 0, micro=ref_extra.get("micro", 1))
        check(f"{name} stage {stage} {tier}", engine, want, counts, low=low)
        engine.close()


def test_every_parameter_with_a_gradient_keeps_one_kernel_call_per_job_and_the_overlap(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The common case is untouched: no runs built, buckets stepped during backward."""
    from zero_offload.engine.step import pipeline as step_mod

    calls = {"whole": 0, "runs": 0}
    whole, runs = step_mod.HostAdam.__call__, step_mod.HostAdam.segments

    def count(kind: str, real: Any) -> Any:
        def wrapped(*args: Any) -> None:
            calls[kind] += 1
            real(*args)
        return wrapped
    monkeypatch.setattr(step_mod.HostAdam, "__call__", count("whole", whole))
    monkeypatch.setattr(step_mod.HostAdam, "segments", count("runs", runs))
    import zero_offload

    model = make_model()
    model.never.requires_grad_(False)
    engine = zero_offload.initialize(model, config(1, "cpu", str(tmp_path)))
    rt = engine.runtime
    during: list[int] = []  # jobs submitted when backward ends (before the rest are reduced)
    end = rt.end_backward

    def end_backward() -> None:
        during.append(rt.shard_optimizer.pipeline._submitted)
        end()
    monkeypatch.setattr(rt, "end_backward", end_backward)
    for step in range(3):
        x, y = data(step, 1)
        engine.backward(engine(x, y, True))
        engine.step()
    assert calls == {"whole": 3 * len(rt.buckets), "runs": 0}, calls
    n = len(rt.buckets)
    assert n > 1 and during == [n, 2 * n, 3 * n], during  # every bucket stepped during backward
    engine.close()


def test_sub_shard_runs_and_checkpoint_scalars(tmp_path: Any) -> None:
    """A range without a gradient across two sub-shards of one shard: not stepped, one step behind
    after, bias-corrected at its own count; lagging() saves it and load_scalars restores it
    (a checkpoint without it, from before per-parameter counts, loads as all at one count)."""
    from zero_offload.config import Config
    from zero_offload.engine.step.shard_optimizer import ShardOptimizer

    def opt_in(name: str) -> ShardOptimizer:
        os.makedirs(tmp_path / name)
        cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path / name),),
                     pinned_budget_bytes=36 * 1024 * 4, optimizer={"lr": 0.1, "weight_decay": 0.5})
        opt = ShardOptimizer(cfg, torch.device("cpu"), capacity_bytes=1 << 22)
        opt.add_shard("s", torch.ones(8192))
        return opt
    opt = opt_in("a")
    assert [(p.lo, p.hi) for p in opt.subshards["s"]] == [(0, 4096), (4096, 8192)]
    ref = [torch.ones(8192, requires_grad=True) for _ in range(2)]  # (stepped twice, once: the gap)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.5)
    grads = [torch.linspace(-1, 1, 8192), torch.linspace(2, -3, 8192)]
    gap = slice(3000, 5000)
    for i, g in enumerate(grads):
        opt.grad_ready("s", g, missing=[(3000, 5000)] if i == 0 else ())
        assert opt.finish_step()
        ref[0].grad = g.clone()
        ref[1].grad = g.clone() if i == 1 else None
        ref_opt.step()
    want = ref[0].detach().clone()
    want[gap] = ref[1].detach()[gap]
    assert torch.allclose(opt.master("s"), want, rtol=1e-6, atol=1e-6)
    assert opt.sub_steps == {"s#0": 2, "s#1": 2} and opt.lagging() == {"s": [[3000, 1096, 1], [4096, 904, 1]]}
    again = opt_in("b")
    again.load_scalars(opt.state_dict_scalars(), lagging=opt.lagging())
    assert again.lag == opt.lag and again.lag == {"s#0": [(3000, 4096, 1)], "s#1": [(4096, 5000, 1)]}
    again.load_scalars(opt.state_dict_scalars())  # an old checkpoint's: no lagging
    assert again.lag == {} and again.sub_steps == {"s#0": 2, "s#1": 2}
    with pytest.raises(ValueError, match="missing ranges"):
        opt.grad_ready("s", grads[0], missing=[(10, 5), (20, 30)])
    opt.close()
    again.close()


@pytest.mark.parametrize("kernel", ["host", "device"])
def test_runs_at_their_own_step_counts_leave_the_gaps_alone(kernel: str) -> None:
    """Each run is stepped as adam_step_flat at its own count; elements in no run keep their
    master and moments, and the updated copy takes the master's values there."""
    from zero_offload.engine.step.pipeline import DeviceAdam, HostAdam, Scalars
    from zero_offload.optim.flat import adam_step_flat

    g = torch.Generator().manual_seed(5)
    n = 3000
    state = [torch.randn(n, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g)]
    grad = torch.randn(n, generator=g)

    def sc(step: int, lr: float) -> Scalars:
        return Scalars(step, lr, 0.9, 0.999, 1e-8, 0.1, True)
    segments = [(0, 700, sc(5, 1e-2)), (700, 1000, sc(2, 1e-2)), (1500, 2000, sc(5, 3e-2)), (2500, 2600, sc(1, 1e-2))]
    ours = [t.clone() for t in state]
    out = torch.empty(n, dtype=torch.bfloat16)
    (HostAdam() if kernel == "host" else DeviceAdam()).segments(ours[0], grad, ours[1], ours[2], segments, out)
    want = [t.clone() for t in state]
    for lo, hi, s in segments:
        adam_step_flat(*(t[lo:hi] for t in (want[0], grad, want[1], want[2])), step=s.step, lr=s.lr, beta1=s.beta1,
                       beta2=s.beta2, eps=s.eps, weight_decay=s.weight_decay, decoupled=True)
    for a, b in zip(ours, want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    for lo, hi in ((1000, 1500), (2000, 2500), (2600, n)):
        assert all(torch.equal(a[lo:hi], b[lo:hi]) for a, b in zip(ours, state))
    assert torch.equal(out, ours[0].to(torch.bfloat16))


# ---- checkpoints ----

@pytest.mark.parametrize("stage,tier", [(2, "cpu"), (3, "nvme")])
def test_resume_in_the_middle_is_bit_exact(stage: int, tier: str, tmp_path: Any) -> None:
    """Saved after step 4 (the branch 2 steps, `never` none): the resumed run equals the straight
    one bit for bit, step counts included; a load with another bucketing keeps every
    parameter's count and goes on as AdamW does."""
    cfg = config(stage, tier, str(tmp_path / "nvme"), pinned_budget_bytes=36 * 1024)
    os.makedirs(tmp_path / "nvme")
    straight = engine_for(cfg)
    train(straight, range(STEPS), 1, 0)
    full, lag = straight.consolidated_state_dict(), straight.runtime.shard_optimizer.lagging(straight.runtime.shard_map())
    straight.close()
    first = engine_for(cfg)
    train(first, range(4), 1, 0)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    resumed = engine_for(cfg)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    train(resumed, range(4, STEPS), 1, 0)
    got = resumed.consolidated_state_dict()
    assert all(torch.equal(got[k], v) for k, v in full.items()), [k for k, v in full.items() if not torch.equal(got[k], v)]
    assert resumed.runtime.shard_optimizer.lagging(resumed.runtime.shard_map()) == lag
    resumed.close()
    if stage == 3:
        return
    other = engine_for({**cfg, "bucket_bytes": 1 << 20})  # one bucket of everything, sub-shards
    other.load_checkpoint(str(tmp_path / "ckpt"))
    _, counts4 = reference(4, 1)
    assert counts4["branch.weight"] == 2 and counts4["never"] == 0
    check_counts("reloaded, another bucketing", other, counts4)
    train(other, range(4, STEPS), 1, 0)
    check("another bucketing", other, *reference(STEPS, 1))
    other.close()


# ---- D = 2 ----

def _two_ranks(rank: int, world: int) -> None:
    """A gradient on both ranks, on rank 0 only, on none; stages 0-2 x tiers, the deferred step
    (clipping) and accumulation; stage 3 where the ranks agree on what is used (a unit used on
    one rank only is refused at stage 3, test_stage3_matrix)."""
    with tempfile.TemporaryDirectory() as nvme_dir:
        want, counts = reference(STEPS, world)
        assert counts["branch.weight"] == 3  # rank 0 alone at step 3
        for stage, tier in ((0, "cpu"), (1, "device"), (2, "cpu")):
            engine = engine_for(config(stage, tier, nvme_dir))
            train(engine, range(STEPS), world, rank)
            check(f"D=2 stage {stage} {tier}", engine, want, counts)
            engine.close()
        for extra, ref_extra, stage, tier in (({"clip_grad_norm": 0.05}, {"clip": 0.05}, 2, "device"),
                                              ({"gradient_accumulation_steps": 2}, {"micro": 2}, 1, "cpu")):
            want_v, counts_v = reference(STEPS, world, **ref_extra)
            engine = engine_for(config(stage, tier, nvme_dir, **extra))
            train(engine, range(STEPS), world, rank, micro=ref_extra.get("micro", 1))
            check(f"D=2 stage {stage} {extra}", engine, want_v, counts_v)
            engine.close()
        want, counts = reference(STEPS, world, one_rank=False)
        engine = engine_for(config(3, "cpu", nvme_dir))
        train(engine, range(STEPS), world, rank, one_rank=False)
        check("D=2 stage 3", engine, want, counts)
        engine.close()


def test_two_ranks_agree_on_what_has_no_gradient() -> None:
    run_ranks(_two_ranks, 2, timeout=240)
