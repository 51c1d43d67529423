"""Stage 3 in one process (D = 1): units, the live budget, the unit state machine, the schedule,
resident units and meta-device construction from an init function or weights on disk."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from torch import nn

from _stage3_model import Model3, batch, make_model, max_rel_err, reference, train_runtime
from zero_offload.config import Config, ConfigError
from zero_offload.engine.model.materialize import save_safetensors
from zero_offload.engine.stage3.runtime import Stage3Runtime
from zero_offload.engine.stage3.unit import GatherBuffers as StagingPool, Unit, UnitState
from zero_offload.store.base import Handle
from zero_offload.store.host import HostStore

CPU = torch.device("cpu")


def config(**stage3: object) -> Config:
    s3 = {"unit_modules": ["Block3"], "live_budget_bytes": 30000, "prefetch_depth": 2, **stage3}
    return Config(stage=3, tiers={"params": "cpu", "optimizer": "cpu", "grads": "cpu"}, stage3=s3,
                  optimizer={"lr": 1e-2, "weight_decay": 0.01})


def test_units_follow_unit_modules_and_tied_weight_has_one_owner() -> None:
    rt = Stage3Runtime(make_model(), config(), CPU)
    names = [u.name for u in rt.units]
    assert names == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    root = rt.units[0]
    assert root.trainable.names == ["pos", "unused", "tok.weight", "ln_f.weight", "ln_f.bias"]
    assert [g.names for g in root.groups if not g.trainable] == [["frozen_gain"]]
    rt.close()


def test_unit_bytes_threshold_chooses_subtrees() -> None:
    model = make_model()
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    rt = Stage3Runtime(model, config(unit_modules=[], unit_bytes=block), CPU)
    assert [u.name for u in rt.units] == ["<root>", "tok", "blocks.0", "blocks.1", "blocks.2", "ln_f"]
    rt.close()


def test_units_chosen_by_size_are_never_a_container_that_is_not_called() -> None:
    """The three blocks fit in unit_bytes together: their ModuleList used to become a unit,
    gathered around a forward that never runs, and the first block read empty parameters."""
    model = make_model()
    assert isinstance(model.blocks, nn.ModuleList)
    rt = Stage3Runtime(model, config(unit_modules=[], unit_bytes=1 << 30, live_budget_bytes=1 << 20), CPU)
    assert [u.name for u in rt.units] == ["<root>", "tok", "blocks.0", "blocks.1", "blocks.2", "ln_f"]
    train_runtime(rt, model, 3, 0, 1, 4)
    _, ref_w = reference(3, 4, lr=1e-2, wd=0.01)
    worst, err = max_rel_err(rt.consolidated_state_dict(), ref_w)
    assert err <= 1e-5, (worst, err)
    rt.close()


@pytest.mark.parametrize("container", ["ModuleList", "ParameterList"])
def test_a_container_named_as_unit_module_is_a_one_line_error(container: str) -> None:
    model = make_model()
    model.extra = nn.ParameterList([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError, match=f"names class '{container}', a container whose forward never runs"):
        Stage3Runtime(model, config(unit_modules=[container]), CPU)


def test_unknown_unit_module_class_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match="names class 'Blok', but the model has no module of that class"):
        Stage3Runtime(make_model(), config(unit_modules=["Blok"]), CPU)


def test_budget_smaller_than_a_unit_is_an_error_naming_unit_and_sizes() -> None:
    rt = Stage3Runtime(make_model(), config(), CPU)
    block, root = rt.units[1].nbytes, rt.units[0].nbytes
    rt.close()
    with pytest.raises(ConfigError) as err:
        Stage3Runtime(make_model(), config(live_budget_bytes=block - 1), CPU)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"stage3.live_budget_bytes = {block - 1} is smaller than unit" in msg
    assert f"({root} bytes gathered" in msg or f"({block} bytes gathered" in msg
    assert str(root + block) in msg  # the block runs inside the root unit's forward


def test_peak_gathered_bytes_stay_within_a_tight_budget() -> None:
    probe = Stage3Runtime(make_model(), config(), CPU)
    need = probe.units[0].nbytes + probe.units[1].nbytes
    probe.close()
    model = make_model()
    rt = Stage3Runtime(model, config(live_budget_bytes=need, prefetch_depth=4), CPU)
    train_runtime(rt, model, 4, 0, 1, 2)
    assert rt.stats()["peak_gathered_bytes"] <= need
    rt.close()


def test_prefetch_serves_later_passes_from_the_record() -> None:
    model = make_model()
    rt = Stage3Runtime(model, config(live_budget_bytes=1 << 20), CPU)
    train_runtime(rt, model, 1, 0, 1, 2)
    first = rt.stats()["on_demand_fetches"]
    train_runtime(rt, model, 3, 0, 1, 2)
    later = rt.stats()["on_demand_fetches"] - first
    # the recording pass fetches everything on demand; later passes nothing (the step starts the
    # next pass's first fetches)
    assert first == len(rt.prefetcher.schedule.recorded) and later == 0, (first, later)
    rt.close()


def test_unit_state_machine_asserts_the_state_it_leaves() -> None:
    rt = Stage3Runtime(make_model(), config(), CPU)
    u = rt.units[1]
    assert u.state is UnitState.SHARDED and all(p.numel() == 0 for p in u.params())
    with pytest.raises(RuntimeError, match=r"unit 'blocks.0': release needs state gathered, it is sharded"):
        u.release()
    u.begin_fetch()
    with pytest.raises(RuntimeError, match="begin_fetch needs state sharded, it is fetching"):
        u.begin_fetch()
    u.fetch_local()
    u.finish_gather()
    assert u.state is UnitState.GATHERED and u.params()[0].shape == rt.units[1].trainable.layout.shapes[0]
    u.release()
    assert all(p.numel() == 0 for p in u.params())
    assert all(g.flat.untyped_storage().nbytes() == 0 for g in u.groups)
    rt.close()


def test_resident_units_stay_gathered_and_train_correctly() -> None:
    model = make_model()
    cfg = config(resident_bytes=6000)  # the root unit (~5.7 kB) stays resident, the blocks (~9.7 kB) do not
    rt = Stage3Runtime(model, cfg, CPU)
    assert [u.resident for u in rt.units] == [True, False, False, False]
    train_runtime(rt, model, 5, 0, 1, 4)
    assert rt.units[0].state is UnitState.GATHERED and rt.stats()["resident_bytes"] == rt.units[0].nbytes
    pending = rt.prefetcher.prefetched  # the next pass's first units, fetched after the step
    assert all(u.state is UnitState.SHARDED for u in rt.units[1:] if u not in pending)
    assert rt.stats()["gathered_bytes"] == sum(u.nbytes for u in pending)
    _, ref_w = reference(5, 4, lr=1e-2, wd=0.01)
    worst, err = max_rel_err(rt.consolidated_state_dict(), ref_w)
    assert err <= 1e-5, (worst, err)
    rt.close()


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return make_model()


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_meta_model_materialized_from_weights_file_trains_like_eager(tmp_path: object, fmt: str) -> None:
    sd = make_model().state_dict()
    path = os.path.join(str(tmp_path), f"w.{fmt}")
    if fmt == "pt":
        torch.save(sd, path)
    else:
        save_safetensors({k: v for k, v in sd.items() if k != "head.weight"}, path)
    model = _meta_model()
    rt = Stage3Runtime(model, config(), CPU, weights=path)
    assert model.head.weight is model.tok.weight and not model.tok.weight.is_meta
    assert torch.equal(model.pos_ids, sd["pos_ids"])
    train_runtime(rt, model, 5, 0, 1, 4)
    _, ref_w = reference(5, 4, lr=1e-2, wd=0.01)
    worst, err = max_rel_err(rt.consolidated_state_dict(), ref_w)
    assert err <= 1e-5, (worst, err)
    rt.close()


def test_missing_tensor_in_weights_file_names_it(tmp_path: object) -> None:
    sd = make_model().state_dict()
    path = os.path.join(str(tmp_path), "w.safetensors")
    save_safetensors({k: v for k, v in sd.items() if k not in ("head.weight", "pos")}, path)
    with pytest.raises(KeyError, match=f"weights file {path} has no tensor 'pos'"):
        Stage3Runtime(_meta_model(), config(), CPU, weights=path)


def test_meta_model_materialized_by_init_function_unit_by_unit() -> None:
    calls: list[str] = []

    def init(module: nn.Module) -> None:
        calls.append(type(module).__name__)
        for name, p in module.named_parameters(recurse=False):
            p.fill_(0.5 if name == "bias" else 0.25)
    model = _meta_model()
    rt = Stage3Runtime(model, config(), CPU, init_fn=init)
    sd = rt.consolidated_state_dict()
    assert "Linear" in calls and calls.count("Linear") == 6  # the tied head is not initialized again
    assert torch.all(sd["blocks.1.fc.bias"] == 0.5) and torch.all(sd["tok.weight"] == 0.25)
    assert torch.all(sd["head.weight"] == 0.25)
    x, y = batch(0, 2)
    with torch.no_grad():
        assert torch.isfinite(model(x, y))
    rt.close()


def test_forward_only_pass_under_no_grad_releases_everything() -> None:
    model = make_model()
    rt = Stage3Runtime(model, config(), CPU)
    x, y = batch(0, 2)
    with torch.no_grad():
        model(x, y)
    assert all(u.state is UnitState.SHARDED for u in rt.units)
    rt.close()



def test_bf16_compute_copy_matches_the_mixed_precision_reference() -> None:
    model = make_model().to(torch.bfloat16)  # as the Engine does: the compute copy starts in bf16
    cfg = Config(stage=3, precision={"dtype": "bf16"}, tiers={"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
                 stage3={"unit_modules": ["Block3"], "live_budget_bytes": 30000},
                 optimizer={"lr": 1e-2, "weight_decay": 0.01})
    rt = Stage3Runtime(model, cfg, CPU)
    assert all(g.flat.dtype == torch.bfloat16 for u in rt.units for g in u.groups)
    losses = train_runtime(rt, model, 10, 0, 1, 4)
    ref_losses, ref_w = reference(10, 4, lr=1e-2, wd=0.01, dtype=torch.bfloat16)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    worst, err = max_rel_err(rt.consolidated_state_dict(), ref_w)
    assert loss_err <= 2e-3 and err <= 3e-2, (loss_err, worst, err)  # the engine's documented bf16 tolerance
    rt.close()


def test_engine_drives_stage3_through_initialize() -> None:
    import zero_offload

    cfg = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
           "stage3": {"unit_modules": ["Block3"], "live_budget_bytes": 30000},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}
    engine = zero_offload.initialize(make_model(), cfg)
    assert type(engine.runtime).__name__ == "Stage3Runtime"
    for step in range(5):
        x, y = batch(step, 4)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    _, ref_w = reference(5, 4, lr=1e-2, wd=0.01)
    worst, err = max_rel_err(engine.runtime.consolidated_state_dict(), ref_w)
    assert err <= 1e-5, (worst, err)
    engine.close()


def test_gradient_accumulation_sums_micro_batches_into_the_grad_shard() -> None:
    import zero_offload

    cfg = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
           "gradient_accumulation_steps": 2,
           "stage3": {"unit_modules": ["Block3"], "live_budget_bytes": 30000},
           "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}
    engine = zero_offload.initialize(make_model(), cfg)
    for step in range(4):
        x, y = batch(step, 4)
        for half in (slice(0, 2), slice(2, 4)):  # two micro-batches make the reference's batch
            loss = engine(x[half], y[half])
            engine.backward(loss)
            engine.step()
    assert engine.global_steps == 4
    _, ref_w = reference(4, 4, lr=1e-2, wd=0.01)
    worst, err = max_rel_err(engine.runtime.consolidated_state_dict(), ref_w)
    assert err <= 1e-5, (worst, err)
    engine.close()


def test_units_chosen_by_size_with_the_tied_head_in_another_unit_train_like_the_reference() -> None:
    model = make_model()
    linear = sum(p.numel() for p in model.blocks[0].fc.parameters()) * 4
    rt = Stage3Runtime(model, config(unit_modules=[], unit_bytes=linear, live_budget_bytes=1 << 20), CPU)
    assert "tok" in [u.name for u in rt.units] and "blocks.0.fc" in [u.name for u in rt.units]
    assert [u.name for u in rt.users[model.head]] == ["tok"]  # the head reads the embedding's unit
    train_runtime(rt, model, 5, 0, 1, 4)
    _, ref_w = reference(5, 4, lr=1e-2, wd=0.01)
    worst, err = max_rel_err(rt.consolidated_state_dict(), ref_w)
    assert err <= 1e-5, (worst, err)
    rt.close()


class _SlowStore(HostStore):
    """A cpu store whose writes land only when waited for (a write still in flight to the drive),
    counting reads: a fetch that read it before the write landed would get the old values."""

    def __init__(self) -> None:
        super().__init__(pin=False)
        self.reads = 0

    def write(self, key: str, src: torch.Tensor) -> Handle:
        return Handle(lambda: super(_SlowStore, self).write(key, src).wait(), src)

    def view(self, key: str) -> torch.Tensor | None:
        return None  # not addressable: fetches go through read()

    def read(self, key: str, dst: torch.Tensor) -> Handle:
        self.reads += 1
        return super().read(key, dst)


def test_fetch_takes_a_shard_still_being_written_from_memory() -> None:
    """The unit updated last in a step is the first the next forward needs: its fetch copies the
    values of the write in flight instead of waiting for it and reading them back."""
    lin = nn.Linear(4, 3)
    store = _SlowStore()
    unit = Unit(0, "lin", [(n, p, p.shape) for n, p in lin.named_parameters()], dtype=torch.float32,
                device=CPU, store=store, staging=StagingPool(store))
    key = unit.groups[0].key
    n = unit.groups[0].layout.shard_numel  # 15 values and padding
    old, new = torch.zeros(n), torch.arange(float(n))
    unit.write_shard(key, old)
    unit.settle_writes()
    unit.write_shard(key, new)  # in flight: the store still holds `old`
    unit.begin_fetch()
    unit.fetch_local()
    unit.finish_gather()
    assert store.reads == 0 and torch.equal(torch.cat([lin.weight.reshape(-1), lin.bias]), new[:15])
    unit.release()
    unit.settle_writes()  # the write lands; the next fetch reads the store
    unit.begin_fetch()
    unit.fetch_local()
    unit.finish_gather()
    assert store.reads == 1 and torch.equal(torch.cat([lin.weight.reshape(-1), lin.bias]), new[:15])
    unit.release()


class _TwiceUnderReentrantCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        y = checkpoint(self.inner, x, use_reentrant=True)  # its backward: a separate autograd pass
        return self.outer(self.inner(y)).pow(2).mean()  # and inner again, outside the checkpoint


def test_a_unit_used_inside_and_outside_a_reentrant_checkpoint_is_a_clear_error() -> None:
    """The unit was reduced (and released) after the outer pass's gradient alone; the reentrant
    pass then ran on its released, empty parameters: "setStorage: ... out of bounds"."""
    import zero_offload

    cfg = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
           "stage3": {"unit_modules": ["Linear"], "live_budget_bytes": 1 << 20}}
    engine = zero_offload.initialize(_TwiceUnderReentrantCheckpoint(), cfg)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="unit 'inner' is needed for backward again .* use use_reentrant=False"):
        engine.backward(engine(x))
    engine.close()


class _MixedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)
        self.fc.bias.requires_grad_(False)  # a frozen bias beside a trainable weight
        self.ln.weight.requires_grad_(False)  # a frozen gain beside a trainable bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(x))


class _TiedWithBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.block = nn.Embedding(16, 8), _MixedBlock()
        self.head = nn.Linear(8, 16)
        self.head.weight = self.tok.weight  # tied; the head keeps its own bias

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.tok(idx))).pow(2).mean()


@pytest.mark.parametrize("units", [["_MixedBlock"], ["_MixedBlock", "Linear"]],
                         ids=["head in the root unit", "head a unit of its own"])
def test_meta_init_reaches_modules_with_frozen_and_tied_parameters(units: list[str]) -> None:
    """The init ran only for modules whose parameters all sat in one flat group and that were
    the first owner of all of them: a LayerNorm with a frozen gain kept a gain of 0, a Linear
    with a frozen bias kept zeros, and the tied head's own bias stayed 0."""
    import zero_offload

    with torch.device("meta"):
        model = _TiedWithBias()
    cfg = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
           "stage3": {"unit_modules": units, "live_budget_bytes": 1 << 20}}
    engine = zero_offload.initialize(model, cfg)
    sd = engine.consolidated_state_dict()
    engine.close()
    assert torch.equal(sd["block.ln.weight"], torch.ones(8)) and torch.equal(sd["block.ln.bias"], torch.zeros(8))
    for name in ("block.fc.weight", "block.fc.bias", "head.bias", "tok.weight"):
        assert sd[name].abs().min() > 0, name  # uniform / normal inits: no exact zero
    assert sd["tok.weight"].std() > 0.5  # the embedding's N(0, 1), not the head's +-1/sqrt(8) overwriting it


class _SharingBlock(nn.Module):
    def __init__(self, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.own, self.shared = nn.Linear(8, 8), shared if shared is not None else nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(self.own(x)))


class _SharedModuleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        first = _SharingBlock()
        self.blocks = nn.ModuleList([first, _SharingBlock(shared=first.shared)])  # one Linear, two blocks
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks[1](self.blocks[0](x))).pow(2).mean()


def test_a_module_shared_by_two_units_is_gathered_where_it_is_called() -> None:
    """The second block's call of the shared Linear found its weight empty ("mat2 must be a
    matrix, got 1-D tensor"): only a Parameter registered twice was seen as shared, not a module."""
    import zero_offload

    cfg = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}, "optimizer": {"lr": 1e-2},
           "stage3": {"unit_modules": ["_SharingBlock"], "live_budget_bytes": 1 << 20}}
    engine, ref = zero_offload.initialize(_SharedModuleNet(), cfg), _SharedModuleNet()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x))
        engine.step()
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    got = engine.consolidated_state_dict()
    engine.close()
    worst, err = max_rel_err(got, {k: v.detach() for k, v in ref.state_dict().items()})
    assert err <= 1e-5, (worst, err)


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor


class _DataclassBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> _Out:
        return _Out(torch.tanh(self.fc(x)))


def test_a_unit_returning_a_dataclass_is_gathered_for_its_backward() -> None:
    """Its output tensor was not found, so no hook gathered the unit again for backward:
    "setStorage: ... out of bounds for storage of size 0"."""
    import zero_offload

    cfg = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
           "stage3": {"unit_modules": ["_DataclassBlock"], "live_budget_bytes": 1 << 20}}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), _DataclassBlock())
    engine = zero_offload.initialize(model, cfg)
    engine.backward(engine(torch.randn(3, 4)).hidden.pow(2).mean())
    assert engine.step()
    engine.close()


def test_init_function_runs_after_each_modules_own_initialization() -> None:
    """As eager construction then model.apply(init_fn): an init that sets only Linear and
    Embedding weights (nanoGPT's _init_weights) leaves LayerNorm at weight 1, bias 0; the engine
    used init_fn instead of reset_parameters, so every LayerNorm weight started at 0 (a review)."""
    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        elif isinstance(module, Model3):  # its own parameters have no reset_parameters: unset, initialize refuses
            for p in module.parameters(recurse=False):
                nn.init.normal_(p, 0.0, 0.02)
    model = _meta_model()
    rt = Stage3Runtime(model, config(), CPU, init_fn=init)
    sd = rt.consolidated_state_dict()
    norms = [k for k in sd if ".ln." in k or k.startswith("ln")]
    assert norms and all(torch.all(sd[k] == (1.0 if k.endswith("weight") else 0.0)) for k in norms), norms
    assert 0.01 < float(sd["blocks.1.fc.weight"].std()) < 0.03  # the init's own values win
    rt.close()


def test_meta_multihead_attention_gets_its_own_initialization() -> None:
    """nn.MultiheadAttention initializes in_proj_weight in _reset_parameters, not
    reset_parameters: built on the meta device it stayed at zero (a review)."""
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x)[0]

    with torch.device("meta"):
        model = Attn()
    rt = Stage3Runtime(model, config(unit_modules=["MultiheadAttention"]), CPU)
    sd = rt.consolidated_state_dict()
    assert float(sd["attn.in_proj_weight"].abs().sum()) > 0
    rt.close()


@pytest.mark.parametrize("leave", ["abandon", "finish_gather"])
def test_a_ctrl_c_while_waiting_for_a_fetch_lets_it_finish_before_the_buffers_go(leave: str) -> None:
    """Ctrl-C landed in the main thread's wait for a prefetch; the cleanup of the interrupted pass
    then freed the unit's buffers while the prefetch thread still copied into them: a segfault in
    about one stage-3 run in three without the native library. The wait now outlasts the Ctrl-C,
    which is raised once the copy has ended."""
    import threading

    rt = Stage3Runtime(make_model(), config(), CPU)
    u = rt.units[1]
    u.begin_fetch()
    copying, done = threading.Event(), threading.Event()

    def fetch() -> None:
        copying.set()
        time.sleep(0.2)
        u.fetch_local()
        done.set()

    worker = threading.Thread(target=fetch)
    worker.start()
    calls = []

    def wait() -> None:
        calls.append(done.is_set())
        if len(calls) == 1:
            copying.wait()
            raise KeyboardInterrupt  # as Ctrl-C lands in Future.result()
        worker.join()

    u.set_pending(wait)
    with pytest.raises(KeyboardInterrupt):
        getattr(u, leave)()
    assert done.is_set() and calls == [False, False], calls
    if u.state is UnitState.FETCHING:
        u.abandon()
    assert all(g.flat.untyped_storage().nbytes() == 0 for g in u.groups)
    rt.close()
