"""Stage 3 through the public facade: a meta model from weights on disk, the consolidated state
dict loaded into the plain model, and checkpoint resume bit for bit."""
from __future__ import annotations

import json
import os
from typing import Callable

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import zero_offload
from _stage3_model import batch, make_model
from zero_offload.config import ConfigError

CFG = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
       "stage3": {"unit_modules": ["Block3"], "live_budget_bytes": 30000},
       "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}


def _meta_engine(weights: str, cfg: dict = CFG) -> zero_offload.engine.engine.Engine:
    with torch.device("meta"):
        model = make_model()
    return zero_offload.initialize(model, cfg, weights=weights)


def _train(engine: object, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, 4)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_meta_model_from_weights_resumes_bit_for_bit_and_consolidates(tmp_path: object) -> None:
    weights = os.path.join(str(tmp_path), "w.pt")
    torch.save(make_model().state_dict(), weights)
    straight = _meta_engine(weights)
    want = _train(straight, range(5))
    want_sd = straight.consolidated_state_dict()
    straight.close()

    first = _meta_engine(weights)
    got = _train(first, range(3))
    first.save_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    first.close()
    resumed = _meta_engine(weights)
    resumed.load_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    got += _train(resumed, range(3, 5))
    got_sd = resumed.consolidated_state_dict()
    resumed.close()

    assert got == want
    for k in want_sd:
        assert torch.equal(got_sd[k], want_sd[k]), k
    plain = make_model()
    plain.load_state_dict(got_sd)  # strict: every key of the plain model, right shapes
    assert torch.equal(plain.tok.weight, got_sd["tok.weight"]) and plain.head.weight is plain.tok.weight


def _two_weight_files(tmp: str) -> tuple[str, str]:
    """The model's weights, and the same with frozen_gain tripled (what a checkpoint must undo)."""
    weights, other = os.path.join(tmp, "w.pt"), os.path.join(tmp, "other.pt")
    torch.save(make_model().state_dict(), weights)
    changed = make_model().state_dict()
    changed["frozen_gain"] = changed["frozen_gain"] * 3.0
    torch.save(changed, other)
    return weights, other


@pytest.mark.parametrize("params_tier", ["cpu", "nvme"])
def test_checkpoint_restores_frozen_parameters_inside_units(tmp_path: object, params_tier: str) -> None:
    """frozen_gain lives in the root unit (sharded, no master): the checkpoint must carry it, so a
    run resumed from weights whose frozen values differ continues exactly as the original."""
    cfg = {**CFG, "tiers": {**CFG["tiers"], "params": params_tier}, "nvme_paths": [str(tmp_path)]}
    weights, other = _two_weight_files(str(tmp_path))
    straight = _meta_engine(weights, cfg)
    want = _train(straight, range(5))
    straight.close()
    first = _meta_engine(weights, cfg)
    got = _train(first, range(3))
    first.save_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    first.close()
    resumed = _meta_engine(other, cfg)
    resumed.load_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    got += _train(resumed, range(3, 5))
    gain = resumed.consolidated_state_dict()["frozen_gain"]
    resumed.close()
    assert got == want
    assert torch.equal(gain, make_model().frozen_gain.detach())


def _save_frozen_at_d2(rank: int, world: int, tmp: str) -> None:
    engine = _meta_engine(os.path.join(tmp, "w.pt"))
    _train(engine, range(3))
    engine.save_checkpoint(os.path.join(tmp, "ckpt"))
    engine.close()


def test_frozen_shards_saved_at_d2_load_at_d1(tmp_path: object) -> None:
    from _dist import run_ranks

    tmp = str(tmp_path)
    _, other = _two_weight_files(tmp)
    run_ranks(_save_frozen_at_d2, 2, tmp=tmp)
    engine = _meta_engine(other)
    engine.load_checkpoint(os.path.join(tmp, "ckpt"))
    gain = engine.consolidated_state_dict()["frozen_gain"]
    engine.close()
    assert torch.equal(gain, make_model().frozen_gain.detach())


def test_meta_model_below_stage_3_is_refused() -> None:
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ConfigError, match="parameters on the meta device"):
        zero_offload.initialize(model, {**CFG, "stage": 2, "tiers": {"optimizer": "cpu"}, "stage3": {}})
    with pytest.raises(ConfigError, match="init_fn and weights .* need stage 3"):
        zero_offload.initialize(make_model(), {"stage": 1}, weights="w.pt")


def test_a_failed_streamed_update_write_is_reported_and_close_cleans_up(tmp_path: object) -> None:
    """Updated shards are written behind the step by the step worker: a write that fails (a full
    drive) must surface as the step's error, and close() must still remove the NVMe files."""
    from zero_offload.store.base import Handle

    nvme = os.path.join(str(tmp_path), "nvme")
    os.makedirs(nvme)
    cfg = {**CFG, "tiers": {"params": "nvme", "optimizer": "cpu", "grads": "cpu"}, "nvme_paths": [nvme]}
    engine = zero_offload.initialize(make_model(), cfg)
    _train(engine, range(1))
    store = engine.runtime.params_store

    def full_drive(key: str, src: torch.Tensor) -> Handle:
        def fail() -> None:
            raise OSError(28, "No space left on device (simulated)")
        return Handle(fail, src)
    store.write = full_drive
    with pytest.raises(RuntimeError, match="No space left on device"):
        _train(engine, range(1, 4))
    del store.write
    engine.close()
    assert os.listdir(nvme) == []


def test_checkpoint_with_other_frozen_parameters_is_refused(tmp_path: object) -> None:
    from zero_offload.engine.state.checkpoint import CheckpointError

    weights, _ = _two_weight_files(str(tmp_path))
    ckpt = os.path.join(str(tmp_path), "ckpt")
    engine = _meta_engine(weights)
    _train(engine, range(1))
    engine.save_checkpoint(ckpt)
    manifest = os.path.join(ckpt, "manifest.json")
    with open(manifest) as f:
        saved = json.load(f)
    saved["frozen_shapes"]["frozen_gain"] = [7]  # as if the model's frozen parameter had changed
    with open(manifest, "w") as f:
        json.dump(saved, f)
    os.remove(os.path.join(ckpt, "manifest.crc32"))  # else the edit fails the manifest's checksum first
    with pytest.raises(CheckpointError, match="does not match the model's frozen parameters.*frozen_gain"):
        engine.load_checkpoint(ckpt)
    engine.close()


@pytest.mark.parametrize("budget,dtype", [(64 << 20, "fp32"), (36 * 1024, "fp32"), (64 << 20, "bf16")],
                         ids=["whole-shards", "sub-shards", "bf16"])
def test_stage3_updates_reach_the_drive_without_bounce_copies(tmp_path: object, budget: int, dtype: str) -> None:
    """Each updated compute-copy shard goes from the step's page-aligned buffer to the params tier's
    drive directly, and so do the initial shards and optimizer state; an unaligned tensor would be
    copied through the swap store's bounce buffers first."""
    cfg = {"stage": 3, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"},
           "nvme_paths": [str(tmp_path)], "pinned_budget_bytes": budget,
           "stage3": {"unit_modules": ["Block3"]}, "optimizer": {"lr": 1e-2}, "precision": {"dtype": dtype}}
    engine = zero_offload.initialize(make_model(), cfg)
    try:
        store = engine.runtime.params_store
        split = any(len(subs) > 1 for subs in engine.runtime.shard_optimizer.subshards.values())
        assert split == (budget < 1 << 20)  # the small budget steps the units in assembled sub-shards
        opt_store = engine.runtime.shard_optimizer.store
        assert store.bounced_transfers == 0 and opt_store.bounced_transfers == 0  # the initial writes too
        _train(engine, range(3))
        assert store.drive_traffic()[1] > 0 and store.bounced_transfers == 0 and opt_store.bounced_transfers == 0
    finally:
        engine.close()


class _LoraBlock(torch.nn.Module):
    """A frozen base Linear and two trainable adapter matrices in one unit, as PEFT's LoRA."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a, self.b = torch.nn.Parameter(torch.randn(d, 4) * 0.1), torch.nn.Parameter(torch.randn(4, d) * 0.1)

    def forward(self, x: torch.Tensor | tuple, inplace: str = "") -> torch.Tensor:
        x = x[0] if isinstance(x, tuple) else x
        if inplace == "before":
            x.mul_(1.0)  # legal on a non-leaf input in plain torch
        xc = x * 1.0  # a copy: nothing saves x itself for backward, so x may change after
        y = torch.tanh(self.base(xc)) + xc @ self.a @ self.b
        if inplace == "after":  # after the frozen base used it: its backward still needs the weights
            x.mul_(1.0)
        return x + y


class _Lora(torch.nn.Module):
    """Blocks called as `style` says; the root unit (inp, ln_f, out) has ln_f frozen, and inp
    too with frozen_root (the root then holds frozen weights its backward needs after the
    blocks' inputs' gradients)."""

    def __init__(self, d: int = 16, style: str = "positional", frozen_root: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.ln_f = torch.nn.LayerNorm(d)
        self.blocks = torch.nn.ModuleList(_LoraBlock(d) for _ in range(3))
        self.ln_f.requires_grad_(False)
        self.inp.requires_grad_(not frozen_root)
        self.style = style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if not x.requires_grad:
            x.requires_grad_()  # as Hugging Face's enable_input_require_grads
        for blk in self.blocks:
            x = {"positional": lambda: blk(x), "keyword": lambda: blk(x=x), "nested": lambda: blk((x, None)),
                 "inplace": lambda: blk(x * 1.0, inplace="before"),
                 "inplace_after": lambda: blk(x, inplace="after"),
                 "reentrant": lambda: checkpoint(blk, x, use_reentrant=True)}[self.style]()
        return self.out(self.ln_f(x)).pow(2).mean()


@pytest.mark.parametrize("style, frozen_root", [("positional", False), ("keyword", False), ("nested", False),
                                                ("inplace", False), ("inplace_after", False), ("reentrant", True),
                                                ("positional", True)])
def test_lora_units_keep_their_frozen_weights_until_their_inputs_gradient(style: str, frozen_root: bool) -> None:
    """A unit was let go once its trainable parameters (the adapters) had reported, while the
    frozen base Linear still had to compute its input's gradient from the released weights:
    backward failed on a 0-byte storage. Inputs passed by keyword or nested were not watched,
    an input modified in place broke the identity Function that watched it, and a root unit
    with frozen weights (ln_f) was let go before the blocks' backward had used them; under a
    reentrant checkpoint (forward without grad) nothing watched a unit's inputs (reviews)."""
    block = sum(p.numel() * 4 for p in _LoraBlock(16).parameters())
    _matches_adamw(lambda: _Lora(style=style, frozen_root=frozen_root), "_LoraBlock", lambda m: 2 * block + 4096, 3)


class _BiasedLora(_LoraBlock):
    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) + shift


class _SharedShift(torch.nn.Module):
    """Every block takes the root's parameter `shift` as an input: a leaf tensor, so a hook on it
    outlives the step unless removed."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shift = torch.nn.Linear(16, 16), torch.nn.Parameter(torch.zeros(16))
        self.blocks = torch.nn.ModuleList(_BiasedLora(16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x, self.shift)
        return x.pow(2).mean()


def test_a_parameter_passed_into_units_is_watched_for_one_pass_only() -> None:
    """The hook that watches a unit's inputs stayed on a leaf input (a parameter passed in) and
    fired again in every later backward, letting units go early; and, on the tensor itself, it
    fired only once every unit fed by it was done, so every block stayed gathered to the end of
    backward (reviews of the fix above). The budget holds the root and two blocks."""
    block = -(-sum(p.numel() for p in _LoraBlock(16).parameters()) // 16) * 16 * 4  # padded to 16

    def root_and_two_blocks(m: _SharedShift) -> int:
        return -(-sum(p.numel() for p in (m.inp.weight, m.inp.bias, m.shift)) // 16) * 16 * 4 + 2 * block
    _matches_adamw(_SharedShift, "_BiasedLora", root_and_two_blocks, 4)


def _matches_adamw(make: Callable[[], torch.nn.Module], unit: str, budget: Callable[[torch.nn.Module], int],
                   steps: int) -> None:
    """`steps` steps at stage 3 (cpu tiers, units of class `unit`, live budget `budget(model)`, no
    read-ahead) equal torch.optim.AdamW on the same model (each returns its loss)."""
    ref = make()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    for x in xs:
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    model = make()
    engine = zero_offload.initialize(model, dict(
        stage=3, tiers={"params": "cpu", "optimizer": "cpu", "grads": "cpu"}, optimizer={"lr": 1e-2},
        stage3={"unit_modules": [unit], "live_budget_bytes": budget(model), "prefetch_depth": 0}))
    for x in xs:
        engine.backward(engine(x))
        engine.step()
    got = engine.consolidated_state_dict()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k
    engine.close()
