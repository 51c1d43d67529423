"""TorchScript submodules train at every stage; QAT checkpoints load as load_state_dict loads them.

A `torch.jit.script(nn.Linear(...))` inside a model trains as eager torch with torch.optim.AdamW
at stages 0-3 (before: internal AttributeErrors, at stages 0-2 from the parameter-binding check,
which read a ScriptModule's _parameters with .get; at stage 3 from the unit policy, which read
its class's forward). At stage 3 it is never a unit root (it takes no hooks): its parameters are
its eager parent's unit's. A model that is itself scripted is refused at stage 3 in one line.

A model prepared for quantization-aware training (torch.ao.quantization.prepare_qat) has
observer and fake-quantize buffers that change shape in the first forward (per-channel min/max,
scale, zero_point: one element, then one per channel). Its checkpoint loads into a fresh engine
as torch's load_state_dict loads the state dict into a fresh model (each module's own
_load_from_state_dict resizes them), and training goes on as in the engine that saved it; a
buffer whose module's loader does not resize it is refused, with torch's own reason.
"""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.config import ConfigError
from zero_offload.engine.state.files import CheckpointError

LR, WD = 1e-2, 0.01


def inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def config(stage: int) -> dict:
    return dict(stage=stage, optimizer={"lr": LR, "weight_decay": WD})


class Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.jit.script(nn.Linear(8, 8))
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.relu(self.a(x))) ** 2).mean()


def make_scripted() -> Scripted:
    torch.manual_seed(0)
    return Scripted()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torchscript_submodule_trains_as_torch(stage: int) -> None:
    ref = make_scripted()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for x in inputs(4):
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    engine = zero_offload.initialize(make_scripted(), config(stage))
    try:
        for x in inputs(4):
            engine.backward(engine(x))
            engine.step()
        got = engine.consolidated_state_dict()
    finally:
        engine.close()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"stage {stage}: {k}")


def test_scripted_model_refused_at_stage3() -> None:
    torch.manual_seed(0)
    model = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    with pytest.raises(ConfigError, match="stage 3 cannot train a model that is itself a TorchScript module") as err:
        zero_offload.initialize(model, config(3))
    assert "\n" not in str(err.value)


class TiedScript(nn.Module):
    """A scripted head sharing the embedding's weight, which lives in the embedding's unit."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = torch.jit.script(nn.Linear(8, 4, bias=False))
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum()


def test_scripted_module_sharing_another_units_weight_refused_at_stage3() -> None:
    model = TiedScript()
    assert model.head.weight is model.emb.weight
    with pytest.raises(ConfigError, match="TorchScript module 'head' .* holds a parameter shared with another unit") as err:
        zero_offload.initialize(model, dict(stage=3, stage3={"unit_modules": ["Embedding", "Linear"]}))
    assert "\n" not in str(err.value)


def make_qat() -> nn.Module:
    from torch.ao.quantization import get_default_qat_qconfig, prepare_qat

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.train()
    model.qconfig = get_default_qat_qconfig("fbgemm")  # per-channel weight observers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notice
        return prepare_qat(model)


def qat_step(engine: zero_offload.Engine, x: torch.Tensor) -> None:
    engine.backward((engine(x) ** 2).mean())
    engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_qat_checkpoint_loads_into_fresh_engine(stage: int) -> None:
    xs = inputs(4)
    fresh_model = make_qat()
    torch_sd = None
    with tempfile.TemporaryDirectory() as d:
        engine = zero_offload.initialize(make_qat(), config(stage))
        try:
            for x in xs[:2]:
                qat_step(engine, x)
            engine.save_checkpoint(f"{d}/ck")
            torch_sd = engine.consolidated_state_dict()
            for x in xs[2:]:
                qat_step(engine, x)
            expected = engine.consolidated_state_dict()
        finally:
            engine.close()
        make_qat().load_state_dict(torch_sd)  # torch itself takes the resized buffers
        fresh = zero_offload.initialize(fresh_model, config(stage))
        try:
            fresh.load_checkpoint(f"{d}/ck")
            for x in xs[2:]:
                qat_step(fresh, x)
            got = fresh.consolidated_state_dict()
        finally:
            fresh.close()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert got[k].shape == v.shape, f"stage {stage}: {k}"
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=0, msg=f"stage {stage}: {k}")
    ref = make_qat()  # and the training itself is eager torch's
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for x in xs:
        (ref(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"stage {stage}, against torch: {k}")


class Growing(nn.Module):
    """A buffer that changes shape in forward, in a module whose loader does not resize it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = torch.zeros(x.shape[0])
        return (self.lin(x) ** 2).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_buffer_torch_would_refuse_still_refused(stage: int) -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        engine = zero_offload.initialize(Growing(), config(stage))
        try:
            engine.backward(engine(inputs(1)[0]))
            engine.step()
            engine.save_checkpoint(f"{d}/ck")
        finally:
            engine.close()
        fresh = zero_offload.initialize(Growing(), config(stage))
        try:
            with pytest.raises(CheckpointError, match=r"'seen' is \(4,\), the model's is \(1,\).*size mismatch") as err:
                fresh.load_checkpoint(f"{d}/ck")
            assert "\n" not in str(err.value)
        finally:
            fresh.close()
