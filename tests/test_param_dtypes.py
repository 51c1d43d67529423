"""Parameters and buffers keep their dtype at every stage; one the engine cannot train is refused.

Only floating-point tensors take the compute dtype. A frozen integer permutation used as an index,
a frozen bool mask, a frozen complex constant and an integer buffer keep their dtype in the
module, in consolidated_state_dict and through a checkpoint, and training matches
torch.optim.AdamW; at stage 3 they stay whole in their module, outside the units (before, stage 3
cast them to the compute dtype and forward failed indexing with a float tensor, and every stage
cast the complex one to float32, dropping its imaginary part). A trainable complex parameter is
refused at initialize in one line naming it, with no cast and no warning.
"""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.config import ConfigError

STEPS, LR, WD = 4, 1e-2, 0.01


def nvme_available() -> bool:
    try:
        import zero_offload.io.swap  # noqa: F401
    except ImportError:
        return False
    return True


class Indexed(nn.Module):
    """Frozen integer, bool and complex parameters beside trainable floats, and an int buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.perm = nn.Parameter(torch.randperm(8), requires_grad=False)
        self.mask = nn.Parameter(torch.rand(8) > 0.3, requires_grad=False)
        self.phase = nn.Parameter(torch.randn(8, dtype=torch.complex64), requires_grad=False)
        self.register_buffer("shift", torch.arange(8) % 3)
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x[:, self.perm] * self.mask) + self.shift
        h = (h.to(torch.complex64) * self.phase).abs()
        return (self.out(h) ** 2).mean()


def make() -> Indexed:
    torch.manual_seed(0)
    return Indexed()


def inputs() -> list[torch.Tensor]:
    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]


def reference() -> dict[str, torch.Tensor]:
    model = make()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for x in inputs():
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def config(stage: int, tier: str, d: str) -> dict:
    tiers = {"optimizer": tier, "grads": tier, **({"params": tier} if stage == 3 else {})}
    return dict(stage=stage, optimizer={"lr": LR, "weight_decay": WD}, tiers=tiers,
                nvme_paths=[d] if tier == "nvme" else [])


def cases() -> list[tuple[int, str]]:
    tiers = ["cpu"] + (["nvme"] if nvme_available() else [])
    return [(s, t) for s in (0, 1, 2, 3) for t in tiers if t == "cpu" or s >= 2]


def assert_matches(sd: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tag: str) -> None:
    assert set(sd) == set(ref), tag
    for k, r in ref.items():
        assert sd[k].dtype == r.dtype, f"{tag}: {k} is {sd[k].dtype}, torch's is {r.dtype}"
        if r.is_floating_point():
            torch.testing.assert_close(sd[k], r, rtol=1e-5, atol=1e-6, msg=f"{tag}: {k}")
        else:
            assert torch.equal(sd[k], r), f"{tag}: {k}"


@pytest.mark.parametrize("stage,tier", cases())
def test_frozen_non_float_params_keep_dtype(stage: int, tier: str) -> None:
    """Trains as torch does; the dtypes stay in the module and survive a checkpoint into a
    fresh engine (whose model was built with other values of the frozen tensors)."""
    ref, tag = reference(), f"stage {stage} {tier}"
    with tempfile.TemporaryDirectory() as d:
        engine = zero_offload.initialize(make(), config(stage, tier, d))
        try:
            for x in inputs():
                engine.backward(engine(x))
                engine.step()
            m = engine.module
            assert (m.perm.dtype, m.mask.dtype, m.phase.dtype, m.shift.dtype) == \
                (torch.int64, torch.bool, torch.complex64, torch.int64), tag
            assert_matches(engine.consolidated_state_dict(), ref, tag)
            engine.save_checkpoint(f"{d}/ck")
        finally:
            engine.close()
        torch.manual_seed(1)
        other = Indexed()  # other frozen values: the checkpoint's must win
        fresh = zero_offload.initialize(other, config(stage, tier, d))
        try:
            fresh.load_checkpoint(f"{d}/ck")
            assert_matches(fresh.consolidated_state_dict(), ref, f"{tag}, loaded")
            fresh.backward(fresh(inputs()[0]))  # forward indexes with the loaded permutation
            fresh.step()
        finally:
            fresh.close()


class Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, dtype=torch.complex64) * 0.3)
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin((x.to(torch.complex64) @ self.w).abs()) ** 2).mean()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainable_complex_refused_at_initialize(stage: int) -> None:
    """One line naming the parameter, before anything is cast (torch would warn "discards the
    imaginary part" on the cast); the model is left as it was."""
    model = Complex()
    before = model.w.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(ConfigError, match=r"trainable parameter 'w' is torch\.complex64") as err:
            zero_offload.initialize(model, dict(stage=stage))
    assert "\n" not in str(err.value)
    assert model.w.dtype == torch.complex64 and torch.equal(model.w.detach(), before)


def _two_ranks(rank: int, world: int, stage: int) -> None:
    """Each rank trains on its half of every batch, from a model built with its own seed (rank
    0's values, the integer and bool ones included, must reach every rank)."""
    torch.manual_seed(rank)
    model = Indexed()
    engine = zero_offload.initialize(model, dict(stage=stage, optimizer={"lr": LR, "weight_decay": WD}))
    try:
        for x in inputs():
            engine.backward(engine(x.chunk(world)[rank]))
            engine.step()
        sd = engine.consolidated_state_dict()
        assert model.perm.dtype == torch.int64 and model.mask.dtype == torch.bool, f"rank {rank}"
    finally:
        engine.close()
    if rank == 0:
        assert_matches(sd, reference(), f"stage {stage} D={world}")


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_non_float_params_at_d2(stage: int) -> None:
    from _dist import run_ranks

    run_ranks(_two_ranks, 2, stage=stage)


def test_meta_integer_param_refused_at_stage3() -> None:
    """A meta integer parameter has no value and nothing fills it (the sources fill floats): one
    line naming it, instead of a float placeholder."""
    with torch.device("meta"):
        model = Indexed()
    with pytest.raises(ConfigError, match=r"frozen torch\.int64 parameter 'perm' is on the meta device") as err:
        zero_offload.initialize(model, dict(stage=3), init_fn=lambda m: None)
    assert "\n" not in str(err.value)
