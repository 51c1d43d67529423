"""Lion, added through the optimizer spec alone (optim/lion.py, lion_kernels.py, one registry line).

Against a plain-torch Lion written here (Chen et al. 2023, decoupled decay) on TinyLM, fp32, D = 1:
losses and every final weight within 1e-5 relative at stage 0 (device tier), stage 2 (cpu), stage 1
(nvme, streamed through the staging ring) and stage 3 (nvme parameters and optimizer); TinyLM's
parameter without a gradient is not stepped; parameter groups step each run with its own
hyperparameters; a checkpoint resumes bit for bit; the ledger and the memory report count Lion's
two fp32 parts (8 bytes per parameter); the config takes Lion's hyperparameters in Lion's ranges.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

from _engine_model import batch, make_model

STEPS, ROWS, LR, BETAS, WD = 10, 2, 1e-3, (0.9, 0.99), 0.1
TOL = 1e-5


def lion_reference(steps: int, groups: list[dict] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of TinyLM trained by Lion, one parameter at a time. `groups`: the
    engine's param_groups (names), each with its own lr / weight_decay."""
    model = make_model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hyper = {n: (LR, WD) for n, _ in named}
    for g in groups or []:
        hyper.update({n: (g.get("lr", LR), g.get("weight_decay", WD)) for n in g["params"]})
    moments = {n: torch.zeros_like(p) for n, p in named}
    losses = []
    for step in range(steps):
        x, y = batch(step, ROWS)
        loss = model(x, y)
        loss.backward()
        losses.append(float(loss.detach()))
        with torch.no_grad():
            for n, p in named:
                if p.grad is None:  # no gradient: not stepped (no decay, no moment update)
                    continue
                lr, wd, m, g = *hyper[n], moments[n], p.grad
                c = BETAS[0] * m + (1 - BETAS[0]) * g
                p.mul_(1 - lr * wd).sub_(lr * torch.sign(c))
                m.mul_(BETAS[1]).add_((1 - BETAS[1]) * g)
                p.grad = None
    return losses, {n: p.detach().clone() for n, p in named}


def lion_config(stage: int, optimizer_tier: str, nvme_dir: str, params_tier: str | None = None) -> dict:
    tiers = {"optimizer": optimizer_tier, "grads": optimizer_tier, **({"params": params_tier} if params_tier else {})}
    nvme = "nvme" in tiers.values()
    return dict(stage=stage, tiers=tiers, bucket_bytes=6000,
                optimizer={"name": "lion", "lr": LR, "betas": list(BETAS), "weight_decay": WD},
                # a few shards' worth: the nvme tier streams every step through the staging ring
                pinned_budget_bytes=100_000, nvme_paths=[nvme_dir] if nvme else [],
                **({"stage3": {"unit_modules": ["TinyBlock"]}} if stage == 3 else {}))


def train(engine: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, ROWS)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def max_rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    errs = {n: float((got[n].float() - w).norm() / w.norm().clamp_min(1e-12)) for n, w in want.items()}
    worst = max(errs, key=errs.get)
    return worst, errs[worst]


CASES = [(0, "device", None), (2, "cpu", None), (1, "nvme", None), (3, "nvme", "nvme")]


@pytest.mark.parametrize("stage, tier, params", CASES, ids=[f"stage{s}-optimizer_{t}" + (f"-params_{p}" if p else "") for s, t, p in CASES])
def test_lion_matches_the_reference(stage: int, tier: str, params: str | None) -> None:
    import zero_offload

    ref_losses, ref_w = lion_reference(STEPS)
    with tempfile.TemporaryDirectory() as d:
        engine = zero_offload.initialize(make_model(), lion_config(stage, tier, d, params))
        try:
            assert engine.runtime.shard_optimizer.spec.part_names == ("master", "m")
            losses = train(engine, range(STEPS))
            got = engine.consolidated_state_dict()
        finally:
            engine.close()
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    worst, w_err = max_rel(got, ref_w)
    assert loss_err <= TOL and w_err <= TOL, f"loss rel err {loss_err:.2e}, {worst} rel err {w_err:.2e}"
    # TinyLM.unused never gets a gradient: Lion leaves it exactly as initialized (no decay)
    assert torch.equal(got["unused"], make_model().unused.detach())


def test_lion_param_groups_step_each_run_with_its_own_hyperparameters() -> None:
    import zero_offload

    names = [n for n, p in make_model().named_parameters() if p.requires_grad]
    groups = [{"params": [n for n in names if n.endswith("weight")]},
              {"params": [n for n in names if not n.endswith("weight")], "lr": 2 * LR, "weight_decay": 0.0}]
    ref_losses, ref_w = lion_reference(STEPS, groups)
    with tempfile.TemporaryDirectory() as d:
        engine = zero_offload.initialize(make_model(), lion_config(2, "cpu", d), param_groups=groups)
        try:
            losses = train(engine, range(STEPS))
            got = engine.consolidated_state_dict()
        finally:
            engine.close()
    worst, w_err = max_rel(got, ref_w)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= TOL and w_err <= TOL, (worst, w_err)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_lion_checkpoint_resumes_bit_exact(tier: str) -> None:
    import zero_offload

    with tempfile.TemporaryDirectory() as d:
        first = zero_offload.initialize(make_model(), lion_config(2, tier, d))
        try:
            train(first, range(STEPS // 2))
            first.save_checkpoint(os.path.join(d, "ck"))
            want_losses = train(first, range(STEPS // 2, STEPS))
            want = first.consolidated_state_dict()
        finally:
            first.close()
        resumed = zero_offload.initialize(make_model(), lion_config(2, tier, d))
        try:
            resumed.load_checkpoint(os.path.join(d, "ck"))
            losses = train(resumed, range(STEPS // 2, STEPS))
            got = resumed.consolidated_state_dict()
        finally:
            resumed.close()
    assert losses == want_losses
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def test_ledger_and_memory_report_count_lion_state() -> None:
    import zero_offload
    from zero_offload import ledger
    from zero_offload.optim.lion import LION

    per_part = 4  # every part is fp32
    assert LION.part_names == ("master", "m") and LION.bytes_per_element == per_part * len(LION.parts) == 8
    assert ledger.bytes_per_param("fp32", LION) == {"weights": 4, "gradients": 4, "optimizer": 8}
    # formula (bf16: weights 2, grads 2, Lion 8) at P = 12, D = 3: stage 0 12*(2+2+8), stage 1
    # 12*(2+2) + 12*8/3, stage 2 12*2 + 12*(2+8)/3, stage 3 12*(2+2+8)/3
    assert [ledger.formula(12, 3, s, LION) for s in range(4)] == [144, 80, 64, 48]
    with tempfile.TemporaryDirectory() as d:
        engine = zero_offload.initialize(make_model(), lion_config(0, "cpu", d))
        try:
            train(engine, range(1))
            report = engine.memory_report(verbose=False)
            so = engine.runtime.shard_optimizer
            held = so.spec.state_bytes(sum(so.numel.values()))
        finally:
            engine.close()
    row = next(r for r in report["rows"] if r["group"] == "optimizer" and r["tier"] == "cpu")
    assert row["ideal"] == 8 * report["params"], report["table"]  # stage 0, fp32: 4 + 4 + 8 per parameter
    assert row["retained"] == held == 8 * sum(so.numel.values()), report["table"]


def test_config_takes_lion_hyperparameters_in_lion_ranges() -> None:
    from zero_offload.config import Config, ConfigError

    cfg = Config(optimizer={"name": "lion", "lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.1})
    assert cfg.optimizer.name == "lion" and cfg.optimizer.betas == (0.9, 0.99)
    with pytest.raises(ConfigError, match=r"optimizer\.betas\[1\].*\[0\.0, 1\.0\)") as bad:
        Config(optimizer={"name": "lion", "betas": [0.9, 1.0]})
    assert "\n" not in str(bad.value)
    # Lion's own range: lr = 0 moves nothing (sign(c) has no scale); AdamW's config takes it
    with pytest.raises(ConfigError, match=r"optimizer\.lr"):
        Config(optimizer={"name": "lion", "lr": 0.0})
    assert Config(optimizer={"name": "adamw", "lr": 0.0}).optimizer.lr == 0.0


@pytest.mark.parametrize("saved, loading", [("adamw", "lion"), ("lion", "adamw")])
def test_a_checkpoint_of_another_optimizer_is_refused_in_one_line(saved: str, loading: str) -> None:
    """AdamW's shards loaded into Lion silently (master and m taken, v dropped), and Lion's into
    AdamW raised KeyError 'v' from inside the load (a review): the manifest names the parts."""
    import zero_offload
    from zero_offload.engine.state.files import CheckpointError

    def cfg(name: str) -> dict:
        return dict(stage=2, tiers={"optimizer": "cpu", "grads": "cpu"}, bucket_bytes=6000,
                    optimizer={"name": name, "lr": LR})

    with tempfile.TemporaryDirectory() as d:
        first = zero_offload.initialize(make_model(), cfg(saved))
        try:
            train(first, range(1))
            first.save_checkpoint(os.path.join(d, "ck"))
        finally:
            first.close()
        other = zero_offload.initialize(make_model(), cfg(loading))
        try:
            with pytest.raises(CheckpointError, match=r"holds optimizer state master\+m.* keeps master\+m") as err:
                other.load_checkpoint(os.path.join(d, "ck"))
        finally:
            other.close()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("device_kernel", [False, True])
def test_lion_kernels_runs_lowp_out_and_nonfinite(device_kernel: bool) -> None:
    """The kernel contract the pipeline relies on: runs step only their elements (each with its
    scalars), lowp_out takes the updated master everywhere, and a NaN update is NonFiniteUpdate."""
    from zero_offload.optim.adamw_kernels import Scalars
    from zero_offload.optim.flat import NonFiniteUpdate
    from zero_offload.optim.lion import LION

    kernel = LION.kernel(device_kernel)(0)
    assert kernel.host is not device_kernel
    gen = torch.Generator().manual_seed(0)
    master, grad, m = (torch.randn(12, generator=gen) for _ in range(3))
    start = (master.clone(), m.clone())
    a = Scalars(step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=0.0, weight_decay=0.5, decoupled=True)
    b = Scalars(step=3, lr=0.01, beta1=0.5, beta2=0.9, eps=0.0, weight_decay=0.0, decoupled=True, grad_scale=2.0)
    out = torch.empty(12, dtype=torch.bfloat16)
    kernel.segments(master, grad, m, [(0, 4, a), (8, 12, b)], out)
    for lo, hi, s in ((0, 4, a), (8, 12, b)):
        g = grad[lo:hi] * s.grad_scale
        c = s.beta1 * start[1][lo:hi] + (1 - s.beta1) * g
        assert torch.allclose(master[lo:hi], start[0][lo:hi] * (1 - s.lr * s.weight_decay) - s.lr * torch.sign(c))
        assert torch.allclose(m[lo:hi], s.beta2 * start[1][lo:hi] + (1 - s.beta2) * g)
    assert torch.equal(master[4:8], start[0][4:8]) and torch.equal(m[4:8], start[1][4:8])  # in no run
    assert torch.equal(out, master.to(torch.bfloat16))
    # torch.sign(NaN) is 0: a NaN gradient leaves the weights finite and the moment NaN (then no
    # later step moves them); an infinite one leaves an infinite moment. Both are refused.
    for bad in (float("nan"), float("inf")):
        g, mm = grad.clone(), m.clone()
        g[5] = bad
        with pytest.raises(NonFiniteUpdate):
            kernel(master.clone(), g, mm, a, None)
        with pytest.raises(NonFiniteUpdate):
            kernel.segments(master.clone(), g, m.clone(), [(4, 8, b)], None)


@pytest.mark.parametrize("tier", ["device", "cpu"])
def test_a_nan_gradient_fails_the_lion_step_in_one_named_line(tier: str) -> None:
    import zero_offload

    with tempfile.TemporaryDirectory() as d:
        engine = zero_offload.initialize(make_model(), lion_config(2, tier, d))
        try:
            x, y = batch(0, ROWS)
            loss = engine(x, y) * float("nan")
            # a device kernel steps inline in backward's hooks: the error may come from either call
            with pytest.raises(Exception, match=r"step 1: the Lion update of optimizer shard .* left Inf or NaN"):
                engine.backward(loss)
                engine.step()
        finally:
            engine.close()
