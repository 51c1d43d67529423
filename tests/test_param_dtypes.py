"""Parameters and buffers keep their dtype at every stage; one the engine cannot train is refused.

Only floating-point tensors take the compute dtype. A frozen integer permutation used as an index,
a frozen bool mask, a frozen complex constant and an integer buffer keep their dtype in the
module, in consolidated_state_dict and through a checkpoint, and training matches
torch.optim.AdamW; at stage 3 they stay whole in their module, outside the units (before, stage 3
cast them to the compute dtype and forward failed indexing with a float tensor, and every stage
cast the complex one to float32, dropping its imaginary part). A trainable complex64 parameter
trains as torch's AdamW steps it, at every stage and tier; one the engine cannot hold (under
bf16, or complex128) is refused at initialize in one line naming it, with no cast and no warning.
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
    """A trainable complex64 weight between odd-sized real parameters (its pairs then sit after a
    gap in the flat buffer, at an even offset), a frozen complex one, and a complex buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(5))
        self.w = nn.Parameter(torch.randn(5, 8, dtype=torch.complex64) * 0.3)
        self.b = nn.Parameter(torch.randn(7))
        self.fixed = nn.Parameter(torch.randn(8, dtype=torch.complex64), requires_grad=False)
        self.register_buffer("rot", torch.exp(1j * torch.arange(8.0)).to(torch.complex64))
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x[:, :5] * self.a).to(torch.complex64) @ self.w * self.fixed * self.rot
        return (self.lin(z.real + z.imag) ** 2).mean() + (self.b ** 2).mean() + z.abs().mean()


def make_complex(seed: int = 0) -> Complex:
    torch.manual_seed(seed)
    return Complex()


def complex_reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = make_complex()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for x in inputs()[:steps]:
        model(x).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def assert_close_all(sd: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tag: str) -> None:
    assert set(sd) == set(ref), tag
    for k, r in ref.items():
        assert sd[k].dtype == r.dtype, f"{tag}: {k} is {sd[k].dtype}, torch's is {r.dtype}"
        torch.testing.assert_close(sd[k], r, rtol=1e-5, atol=1e-6, msg=f"{tag}: {k}")


@pytest.mark.parametrize("stage,tier", cases())
def test_complex_params_step_as_torch_adamw(stage: int, tier: str) -> None:
    """torch's AdamW steps a complex parameter through view_as_real (moments per real and per
    imaginary part, weight decay on both): so does the engine, whose flat buffers hold it as
    float32 pairs. Before, every stage cast it to float32 (its imaginary part dropped, a warning
    the only sign). A checkpoint loads into a fresh engine, which trains on as the first does."""
    ref, tag = complex_reference(), f"stage {stage} {tier}"
    with tempfile.TemporaryDirectory() as d:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*imaginary part.*")
            engine = zero_offload.initialize(make_complex(), config(stage, tier, d))
        try:
            for i, x in enumerate(inputs()):
                engine.backward(engine(x))
                engine.step()
                if i == STEPS - 2:
                    engine.save_checkpoint(f"{d}/ck")
            assert_close_all(engine.consolidated_state_dict(), ref, tag)
            assert engine.module.w.dtype == torch.complex64, f"{tag}: between passes too"
        finally:
            engine.close()
        fresh = zero_offload.initialize(make_complex(seed=1), config(stage, tier, d))
        try:
            fresh.load_checkpoint(f"{d}/ck")
            fresh.backward(fresh(inputs()[-1]))
            fresh.step()
            assert_close_all(fresh.consolidated_state_dict(), ref, f"{tag}, loaded")
        finally:
            fresh.close()


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("precision,dtype", [("bf16", torch.complex64), ("fp32", torch.complex128)])
def test_complex_the_engine_cannot_hold_refused(stage: int, precision: str, dtype: torch.dtype) -> None:
    """complex64 pairs need float32 flat buffers (no bf16 complex exists); a complex128 one would
    be cast. One line naming the parameter, before anything is cast; the model is as it was."""
    model = nn.Linear(4, 4)
    model.z = nn.Parameter(torch.randn(4, dtype=dtype))
    before = model.z.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with pytest.raises(ConfigError, match=rf"trainable parameter 'z' is {dtype}") as err:
            zero_offload.initialize(model, dict(stage=stage, precision={"dtype": precision}))
    assert "\n" not in str(err.value)
    assert model.z.dtype == dtype and torch.equal(model.z.detach(), before)


def _two_ranks(rank: int, world: int, stage: int) -> None:
    """Each rank trains on its half of every batch, from models built with its own seed (rank
    0's values, the integer, bool and complex ones included, must reach every rank); the
    complex parameter's pairs are split between the two shards."""
    torch.manual_seed(rank)
    model = Indexed()
    cplx = make_complex(seed=rank)
    cfg = dict(stage=stage, optimizer={"lr": LR, "weight_decay": WD})
    engine, engine_c = zero_offload.initialize(model, cfg), zero_offload.initialize(cplx, cfg)
    try:
        for x in inputs():
            for e in (engine, engine_c):
                e.backward(e(x.chunk(world)[rank]))
                e.step()
        sd, sd_c = engine.consolidated_state_dict(), engine_c.consolidated_state_dict()
        assert model.perm.dtype == torch.int64 and model.mask.dtype == torch.bool, f"rank {rank}"
    finally:
        engine.close()
        engine_c.close()
    if rank == 0:
        assert_matches(sd, reference(), f"stage {stage} D={world}")
        assert_close_all(sd_c, complex_reference(), f"stage {stage} D={world}, complex")


@pytest.mark.parametrize("stage", [1, 3])
def test_dtypes_at_d2(stage: int) -> None:
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


def test_layout_holds_complex_as_pairs() -> None:
    """partition.FlatLayout: a complex entry takes 2 elements per value at an even offset (the gap
    before it zeroed by flatten), comes back from views as the complex tensor itself, and its
    pieces, shard_from and scatter_into count real elements."""
    from zero_offload.partition import FlatLayout

    real, z = torch.arange(3.0), torch.randn(2, 3, dtype=torch.complex64)
    layout = FlatLayout.build([real.shape, z.shape], world=2, align=1, pairs=[False, True])
    assert layout.offsets == (0, 4) and layout.numel == 16 and layout.gaps
    flat = layout.flatten([real, z], aligned=False, dtype=torch.float32)
    assert flat[3] == 0 and torch.equal(flat[4:16], torch.view_as_real(z).reshape(-1))
    views = layout.views(flat)
    assert views[1].dtype == torch.complex64 and torch.equal(views[1], z)
    out = [torch.zeros(3), torch.zeros(2, 3, dtype=torch.complex64)]
    for rank in range(2):
        shard = layout.shard_from([real, z], rank, torch.empty(layout.shard_numel))
        layout.scatter_into(shard, rank, out)
    assert torch.equal(out[0], real) and torch.equal(out[1], z)


@pytest.mark.parametrize("stage", [0, 3])
def test_lazy_module_uninitialized_refused(stage: int) -> None:
    """A lazy module not yet run has parameters without a shape: one line naming the first, not
    torch's error from inside the engine's layout code."""
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    with pytest.raises(ConfigError, match=r"'0\.weight' is uninitialized \(a lazy module's") as err:
        zero_offload.initialize(model, dict(stage=stage))
    assert "\n" not in str(err.value)
    model(torch.randn(2, 3))  # once run, it trains
    engine = zero_offload.initialize(model, dict(stage=stage))
    try:
        engine.backward(engine(torch.randn(2, 3)).sum())
        engine.step()
    finally:
        engine.close()
