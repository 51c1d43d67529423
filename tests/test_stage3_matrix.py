"""Stage 3 x parameter tier x optimizer tier at D = 1, 2, 3 against the single-process AdamW reference.

One spawned job per D loops over the tier matrix inside the ranks; each rank computes the
reference itself. The model (tests/_stage3_model.py) has tied weights, a frozen parameter, a buffer,
a parameter with no gradient, a block called twice and a checkpointed block. Checked per combination,
from the engine's own accounting: fp32 losses and weights within 1e-5 relative, peak gathered
bytes <= live budget, nothing left gathered.

The order-change test runs the blocks in another order from step 10 on (data-dependent control
flow, decided alike on every rank): that pass falls back to on-demand fetches, the order is
recorded again (exactly once), and training still matches the reference. The gradient arrival
order changes with it, which the optimizer tier's prefetch must also survive.
"""
from __future__ import annotations

import tempfile

import pytest
import torch

from _dist import run_ranks

STEPS, ROWS, LR, WD, SWAP = 20, 2, 1e-2, 0.01, 10
BUDGET = 30000  # bytes: the root unit (~5.7 kB) plus about two blocks (~9.7 kB each)


def nvme_available() -> bool:
    try:
        import zero_offload.io.swap  # noqa: F401
    except ImportError:
        return False
    return True


def combos() -> list[tuple[str, str]]:
    tiers = [("device", "device"), ("cpu", "cpu"), ("cpu", "device"), ("device", "cpu")]
    if nvme_available():
        tiers += [("nvme", "nvme"), ("nvme", "cpu"), ("cpu", "nvme")]
    return [(p, o) for p, o in tiers if not (p != "device" and o == "device")]


def run_one(params: str, opt: str, rank: int, world: int, nvme_dir: str, swap: int | None = None,
            resident: int = 0) -> None:
    from _stage3_model import make_model, max_rel_err, reference, train_runtime
    from zero_offload import comm
    from zero_offload.config import Config
    from zero_offload.engine.stage3.runtime import Stage3Runtime
    from zero_offload.engine.stage3.unit import UnitState

    cfg = Config(stage=3, tiers={"params": params, "optimizer": opt, "grads": opt}, 
                 stage3={"unit_modules": ["Block3"], "live_budget_bytes": BUDGET, "prefetch_depth": 2,
                         "resident_bytes": resident},
                 optimizer={"lr": LR, "weight_decay": WD}, nvme_paths=[nvme_dir] if "nvme" in (params, opt) else [])
    model = make_model()
    rt = Stage3Runtime(model, cfg, torch.device("cpu"))
    try:
        losses = train_runtime(rt, model, STEPS, rank, world, ROWS, swap_from=swap)
        losses = [float(comm.all_reduce_(torch.tensor([v]))[0]) / world for v in losses]
        weights = rt.consolidated_state_dict()
        stats = rt.stats()
        pending = rt.prefetcher.prefetched  # the next pass's first units, fetched after the step
        assert all(u.state is UnitState.SHARDED for u in rt.units if not u.resident and u not in pending)
        assert stats["gathered_bytes"] == sum(u.nbytes for u in pending), stats
    finally:
        rt.close()
    ref_losses, ref_w = reference(STEPS, ROWS * world, lr=LR, wd=WD, swap_from=swap)
    tag = f"D={world} params={params} optimizer={opt} order change at {swap} resident {resident}"
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    worst, w_err = max_rel_err(weights, ref_w)
    tol = 1e-5
    assert loss_err <= tol and w_err <= tol, f"{tag}: loss rel err {loss_err:.2e}, {worst} rel err {w_err:.2e}"
    assert 0 < stats["peak_gathered_bytes"] <= BUDGET, f"{tag}: {stats}"
    assert stats["rerecorded_passes"] == (0 if swap is None else 1), f"{tag}: {stats}"


def _matrix(rank: int, world: int) -> None:
    with tempfile.TemporaryDirectory() as nvme_dir:
        for params, opt in combos():
            if world == 3 and params != opt:
                continue  # D = 3 (uneven shards, padding) runs the matched tiers only, to keep CI time down
            run_one(params, opt, rank, world, nvme_dir)
        if world == 2:  # the root unit (~5.7 kB) resident: gathered once, updated in place after each step
            run_one("nvme" if nvme_available() else "cpu", "cpu", rank, world, nvme_dir, resident=6000)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stage3_matches_reference(world: int) -> None:
    run_ranks(_matrix, world, timeout=150)


def _order_change(rank: int, world: int, combo: tuple[str, str]) -> None:
    with tempfile.TemporaryDirectory() as nvme_dir:
        run_one(*combo, rank, world, nvme_dir, swap=SWAP)


@pytest.mark.parametrize("combo", [("cpu", "cpu"), ("nvme", "cpu"), ("cpu", "nvme")], ids="-".join)
def test_stage3_order_change_mid_run(combo: tuple[str, str]) -> None:
    if "nvme" in combo and not nvme_available():
        pytest.skip("zero_offload.io.swap is not available")
    run_ranks(_order_change, 2, timeout=100, combo=combo)


def _diverging_ranks(rank: int, world: int) -> None:
    from _stage3_model import batch, make_model
    from zero_offload.config import Config
    from zero_offload.engine.stage3.runtime import Stage3Runtime

    cfg = Config(stage=3, tiers={"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
                 stage3={"unit_modules": ["Block3"], "live_budget_bytes": BUDGET})
    model = make_model()
    rt = Stage3Runtime(model, cfg, torch.device("cpu"))
    model.swap = rank == 1  # control flow that differs between ranks
    x, y = batch(0, 2)
    try:
        with pytest.raises(RuntimeError, match="stage 3: ranks gather different units next"):
            model(x, y)
    finally:
        rt.close()  # its threads stopped before the process exits (a prefetch may be in flight)


def test_ranks_that_run_different_units_fail_fast_instead_of_hanging() -> None:
    run_ranks(_diverging_ranks, 2, timeout=60)


class _Gated(torch.nn.Module):
    """Two blocks; rank 1 also runs `gate` inside the first (a parameter that gets a gradient on
    some ranks only: an expert no token reached, a loss term one rank skipped)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_GatedBlock() for _ in range(2))
        self.use_gate = rank == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, self.use_gate)
        return x.pow(2).mean()


class _GatedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.gate = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, gated: bool) -> torch.Tensor:
        return self.fc(x) + (self.gate(x) if gated else 0)


def _unused_on_one_rank(rank: int, world: int, resident: int) -> None:
    import zero_offload

    engine = zero_offload.initialize(_Gated(rank), dict(
        stage=3, tiers={"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
        stage3={"unit_modules": ["_GatedBlock"], "resident_bytes": resident}))
    with pytest.raises(RuntimeError, match="stage 3: ranks (reduce|gather) different units next.*a gradient on every rank"):
        engine.backward(engine(torch.randn(4, 8)))
    engine.close()


@pytest.mark.parametrize("resident", [0, 1 << 20], ids=["gathered", "resident"])
def test_a_parameter_used_on_some_ranks_only_fails_fast(resident: int) -> None:
    """Ranks reduced the units in their own backward's order: rank 0 reduced the gated block
    after backward, rank 1 during it. The collectives paired up wrongly: gloo aborted the
    process, or (every unit resident, so no gathers in backward) the weights came out wrong
    without a word (a review)."""
    run_ranks(_unused_on_one_rank, 2, timeout=60, resident=resident)


class _TwoBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.pow(2).mean()


def _eval_on_rank0_only(rank: int, world: int) -> None:
    import zero_offload

    engine = zero_offload.initialize(_TwoBlocks(), dict(
        stage=3, tiers={"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
        stage3={"unit_modules": ["Linear"], "resident_bytes": 0}))
    engine.backward(engine(torch.randn(4, 8)))
    engine.step()
    with pytest.raises(RuntimeError, match="gather .blocks.0. with(out)? grad.*an evaluation forward must run on every rank"):
        if rank == 0:
            with torch.no_grad():
                engine(torch.randn(4, 8))
        engine.backward(engine(torch.randn(4, 8)))
    engine.close()


def test_an_evaluation_forward_on_one_rank_fails_fast_on_every_rank() -> None:
    """`if rank == 0: evaluate()` at stage 3: rank 0's gathers for its no-grad forward paired
    with rank 1's training gathers of the same units, and the ranks then met in mismatched
    collectives (a hang until the launcher's timeout). A gather's check now tells a forward with
    grad from one without, so both ranks fail at the first unit with a line that says why."""
    run_ranks(_eval_on_rank0_only, 2, timeout=60)
