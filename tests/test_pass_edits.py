"""In-place writes to parameters during a pass, and forwards inside `engine.gathered`, at stage 3.

A stage-3 parameter is a view of its unit's gathered flat buffer while the unit is used; the
buffer is dropped at release. A write made in forward (Embedding(max_norm)'s renorm, an EMA
update of a frozen teacher) landed in that copy and was lost without a word: eager torch keeps
it. A forward (or `generate`) inside `engine.gathered(...)` released the block's units and gave
their budget back twice, and every later pass failed. Both are checked here against torch.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import zero_offload
from _dist import run_ranks

LR, WD = 1e-2, 0.01


class _Renorm(nn.Module):
    """nn.Embedding(max_norm) renormalizes the rows it looks up, in place, in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8, max_norm=1.0)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.head(self.emb(x)).mean(1) - y).pow(2).mean()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Teacher(nn.Module):
    """A frozen EMA copy updated under no_grad in forward (MoCo/BYOL): in one unit with the
    student (`stacks=False`) or as its own stack of units, read outside their unit."""

    def __init__(self, stacks: bool) -> None:
        super().__init__()
        make = (lambda: nn.ModuleList([_Block() for _ in range(3)])) if stacks else (lambda: nn.Linear(8, 8))
        self.student, self.teacher = make(), make()
        self.teacher.load_state_dict(self.student.state_dict())
        self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for pt, ps in zip(self.teacher.parameters(), self.student.parameters()):
                pt.mul_(0.9).add_(ps.detach(), alpha=0.1)
        return (self._run(self.student, x) - self._run(self.teacher, x) - y).pow(2).mean()

    @staticmethod
    def _run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for blk in (m if isinstance(m, nn.ModuleList) else [m]):
            x = blk(x)
        return x


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return _Renorm() if kind == "renorm" else _Teacher(stacks=kind == "teacher_stacks")


def _batch(kind: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    if kind == "renorm":
        return torch.randint(0, 32, (4, 5), generator=g), torch.randn(4, 4, generator=g)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _reference(model: nn.Module, kind: str, steps: int) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for i in range(steps):
        m(*_batch(kind, i)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _config(stage: int, tier: str, tmp_path: Path | str) -> zero_offload.Config:
    tiers = {"optimizer": tier, "grads": "device" if tier == "device" else "cpu", **({"params": tier} if stage == 3 else {})}
    return zero_offload.Config(stage=stage, tiers=tiers, nvme_paths=[str(tmp_path)],
                               optimizer={"lr": LR, "weight_decay": WD})


def _train(engine: zero_offload.engine.engine.Engine, kind: str, steps: int) -> dict[str, torch.Tensor]:
    for i in range(steps):
        engine.backward(engine(*_batch(kind, i)))
        engine.step()
    if engine.config.stage == 3:
        return engine.consolidated_state_dict()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("kind", ["renorm", "teacher", "teacher_stacks"])
@pytest.mark.parametrize("stage,tier", [(0, "device"), (2, "cpu"), (3, "cpu"), (3, "nvme")])
def test_writes_in_forward_are_kept_as_torch_keeps_them(kind: str, stage: int, tier: str, tmp_path: Path) -> None:
    model = _model(kind)
    engine = zero_offload.initialize(copy.deepcopy(model), _config(stage, tier, tmp_path))
    got = _train(engine, kind, 3)
    engine.close()
    _assert_close(got, _reference(model, kind, 3))


def test_a_renorm_in_an_evaluation_forward_is_kept(tmp_path: Path) -> None:
    """torch renorms in an evaluation forward too: the next step trains from the renormed rows."""
    model = _model("renorm")
    engine = zero_offload.initialize(copy.deepcopy(model), _config(3, "nvme", tmp_path))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for i in range(3):
        with torch.no_grad():  # an evaluation forward on another batch between steps
            engine(*_batch("renorm", 50 + i))
            ref(*_batch("renorm", 50 + i))
        engine.backward(engine(*_batch("renorm", i)))
        engine.step()
        ref(*_batch("renorm", i)).backward()
        opt.step()
        opt.zero_grad()
    got = engine.consolidated_state_dict()
    engine.close()
    _assert_close(got, ref.state_dict())


def _two_rank_renorm(rank: int, world: int, nvme_dir: str) -> None:
    """Every rank sees the same batch, so eager torch on one process is the reference; each rank
    keeps the write to its own shard (no collective: ranks need not agree that a write happened)."""
    model = _model("renorm")
    engine = zero_offload.initialize(copy.deepcopy(model), _config(3, "nvme", nvme_dir))
    got = _train(engine, "renorm", 3)
    engine.close()
    if rank == 0:
        _assert_close(got, _reference(model, "renorm", 3))


def test_writes_in_forward_at_two_ranks(tmp_path: Path) -> None:
    run_ranks(_two_rank_renorm, 2, timeout=90, nvme_dir=str(tmp_path))


def test_a_trainable_write_in_backward_is_refused(tmp_path: Path) -> None:
    """A hook that edits a trainable weight in backward: its shard may have been stepped already."""
    model = _model("renorm")
    engine = zero_offload.initialize(model, _config(3, "cpu", tmp_path))

    def edit(grad: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            engine.module.emb.weight.mul_(0.5)
        return grad

    engine.module.emb.weight.register_hook(edit)  # runs while the embedding's unit is gathered for backward
    loss = engine(*_batch("renorm", 0))
    with pytest.raises(RuntimeError, match="'emb.weight'.*changed in place during backward"):
        engine.backward(loss)
    engine.close()


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.out(x) if y is None else (self.out(x) - y).pow(2).mean()


def _assert_budget_matches(engine: zero_offload.engine.engine.Engine) -> None:
    """The live budget counts exactly the units gathered or being read ahead."""
    rt = engine.runtime
    held = sum(u.nbytes for u in rt.units if not u.resident and u.state.value != "sharded")
    assert rt.prefetcher.budget.live == held


def _tiny_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_forward_inside_gathered_during_and_after_training(tier: str, tmp_path: Path) -> None:
    """Train, run forwards inside and outside `engine.gathered`, train on: the weights are
    torch's, the live budget is back to zero, and the outputs are eager torch's."""
    torch.manual_seed(0)
    model = _Tiny()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    engine = zero_offload.initialize(model, _config(3, tier, tmp_path))
    probe = torch.randn(2, 8)
    for i in range(4):
        engine.backward(engine(*_tiny_batch(i)))
        engine.step()
        ref(*_tiny_batch(i)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            want = ref(probe)
            with engine.gathered():
                inside = engine(probe)
                again = engine.module.blocks[0](probe)  # a unit's own module, called directly
            outside = engine(probe)
        torch.testing.assert_close(inside, want)
        torch.testing.assert_close(outside, want)
        torch.testing.assert_close(again, ref.blocks[0](probe))
        _assert_budget_matches(engine)
    got = engine.consolidated_state_dict()
    engine.close()
    _assert_close(got, ref.state_dict())


def test_backward_inside_gathered_is_refused_and_the_engine_goes_on(tmp_path: Path) -> None:
    torch.manual_seed(0)
    engine = zero_offload.initialize(_Tiny(), _config(3, "cpu", tmp_path))
    with engine.gathered():
        loss = engine(*_tiny_batch(0))
        with pytest.raises(RuntimeError, match="engine.backward inside engine.gathered"):
            engine.backward(loss)
    engine.backward(engine(*_tiny_batch(1)))
    engine.step()
    _assert_budget_matches(engine)
    engine.close()


def test_an_in_place_edit_inside_gathered_without_modify_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    engine = zero_offload.initialize(_Tiny(), _config(3, "cpu", tmp_path))
    with engine.gathered(engine.module.out):
        before = engine.module.out.weight.detach().clone()
    with pytest.raises(RuntimeError, match="'out.weight'.*modify=False.*pass modify=True"):
        with engine.gathered(engine.module.out):
            with torch.no_grad():
                engine.module.out.weight.zero_()
    with engine.gathered(engine.module.out):
        torch.testing.assert_close(engine.module.out.weight, before)  # the shards are as they were
    engine.close()


def test_generate_after_training_a_transformers_model(tmp_path: Path) -> None:
    """A tiny Llama trained at stage 3, then `generate` inside and outside `engine.gathered`,
    then trained on: the greedy tokens are eager torch's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    engine = zero_offload.initialize(model, _config(3, "nvme", tmp_path))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=4, do_sample=False, min_new_tokens=4)
    for _ in range(2):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        ref(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        want = ref.generate(x[:1, :4], **gen)
        with engine.gathered():
            inside = engine.module.generate(x[:1, :4], **gen)
        outside = engine.module.generate(x[:1, :4], **gen)
        assert inside.tolist() == want.tolist() and outside.tolist() == want.tolist()
    engine.close()


def test_a_weight_taken_inside_gathered_outlives_the_block(tmp_path: Path) -> None:
    """`w = p.detach()` inside the block shared the unit's flat buffer, freed at the block's end:
    `w.sum()` afterwards read freed memory and crashed the process (a segmentation fault). The
    tensor keeps its values now, as in eager torch, and the unit trains on from its shards."""
    torch.manual_seed(0)
    model = _Tiny()
    ref = copy.deepcopy(model)
    engine = zero_offload.initialize(model, _config(3, "cpu", tmp_path))
    with engine.gathered():
        w = engine.module.out.weight.detach()
        view = engine.module.blocks[0].lin.weight[0]
        want_w, want_view = w.clone(), view.detach().clone()
    torch.testing.assert_close(w, want_w)  # read after the block: its own storage now
    torch.testing.assert_close(view.detach(), want_view)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for i in range(2):
        engine.backward(engine(*_tiny_batch(i)))
        engine.step()
        ref(*_tiny_batch(i)).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(w, want_w)  # unlike torch's, it does not follow the steps (docs/limits.md)
    _assert_close(engine.consolidated_state_dict(), ref.state_dict())
    _assert_budget_matches(engine)
    engine.close()
