"""Sub-shards (engine/step/subshards.py): a shard larger than a third of the staging ring is stepped sub-shard by
sub-shard on the nvme tier, with the same result, bit for bit, as stepping it whole."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine.step.subshards import subshard_limit, split
from zero_offload.engine.step.shard_optimizer import ShardOptimizer
from zero_offload.engine.step.staging_ring import ALIGN_ELEMENTS as ALIGN


def test_split_covers_the_shard_in_aligned_subshards() -> None:
    assert [(p.key, p.lo, p.hi) for p in split("k", 5000, None)] == [("k", 0, 5000)]
    assert [(p.key, p.lo, p.hi) for p in split("k", 5000, 5000)] == [("k", 0, 5000)]
    subs = split("k", 10 * ALIGN + 7, 3 * ALIGN)
    assert [p.key for p in subs] == ["k#0", "k#1", "k#2", "k#3"]
    assert subs[0].lo == 0 and subs[-1].hi == 10 * ALIGN + 7
    assert all(a.hi == b.lo for a, b in zip(subs, subs[1:]))
    assert all(p.lo % ALIGN == 0 and p.numel <= 3 * ALIGN for p in subs)
    assert {p.owner for p in subs} == {"k"}
    assert subshard_limit(36 * 4 * ALIGN) == 4 * ALIGN and subshard_limit(1) == ALIGN


def _optimizer(tmp_path: Path, budget: int, dtype: str, updated: dict, *, clip: float = 0.0,
               stream: bool = False) -> ShardOptimizer:
    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),),
                 pinned_budget_bytes=budget, clip_grad_norm=clip, precision={"dtype": dtype},
                 optimizer={"lr": 1e-2, "weight_decay": 0.1})

    def receive(key: str, shard: torch.Tensor, owned: bool) -> None:
        updated[key] = shard.clone()
    return ShardOptimizer(cfg, torch.device("cpu"), receive, capacity_bytes=16 << 20, stream_updates=stream)


@pytest.mark.parametrize("dtype,clip,stream", [("fp32", 0.0, False), ("bf16", 0.0, True), ("fp32", 0.5, False)])
def test_subshards_step_exactly_like_a_whole_shard(tmp_path: Path, dtype: str, clip: float, stream: bool) -> None:
    sizes = {"big": 20 * ALIGN + 5, "small": 300}
    runs = []
    for budget in (64 << 20, 36 * 4 * ALIGN):  # whole shards; sub-shards of at most 4 * ALIGN
        updated: dict[str, torch.Tensor] = {}
        (tmp_path / str(budget)).mkdir()
        opt = _optimizer(tmp_path / str(budget), budget, dtype, updated, clip=clip, stream=stream)
        gen = torch.Generator().manual_seed(0)
        for key, n in sizes.items():
            opt.add_shard(key, torch.randn(n, generator=gen))
        history = []
        for _ in range(4):
            for key, n in sizes.items():
                opt.grad_ready(key, torch.randn(n, generator=gen), owned=True)
            assert opt.finish_step()
            history.append({k: v.clone() for k, v in updated.items()})
        runs.append((opt, history, {k: opt.read_state(k) for k in sizes}, len(opt.planned())))
    (whole, h_whole, s_whole, n_whole), (split_opt, h_split, s_split, n_split) = runs
    assert n_whole == 2 and n_split == 7  # 20 * ALIGN + 5 elements make six sub-shards
    for a, b in zip(h_whole, h_split):
        assert a.keys() == b.keys() == set(sizes)
        for key in sizes:
            assert torch.equal(a[key], b[key]), key  # whole shards reach the receiver, bit for bit
    for key in sizes:
        for part in ("master", "m", "v"):
            assert torch.equal(s_whole[key][part], s_split[key][part]), (key, part)
    whole.close()
    split_opt.close()


def test_write_state_then_read_state_round_trips_through_subshards(tmp_path: Path) -> None:
    opt = _optimizer(tmp_path, 36 * 4 * ALIGN, "fp32", {})
    n = 9 * ALIGN + 11
    opt.add_shard("k", torch.zeros(n))
    parts = {p: torch.randn(n) for p in ("master", "m", "v")}
    opt.write_state("k", parts)
    back = opt.read_state("k")
    assert all(torch.equal(back[p], parts[p]) for p in parts)
    with pytest.raises(ValueError, match="m has 3 elements"):
        opt.write_state("k", {**parts, "m": torch.zeros(3)})
    opt.close()


def test_stage3_units_in_subshards_train_and_resume_like_whole_ones(tmp_path: Path) -> None:
    """Stage 3 with parameters and optimizer state on nvme and a staging budget that splits every
    unit's shard: the same losses and weights, bit for bit, as the cpu tiers, through a
    checkpoint save and resume in the middle."""
    import zero_offload
    from _stage3_model import make_model
    from test_stage3_engine import _train

    def run(cfg: dict, steps: range, engine: object = None) -> tuple[object, list[float]]:
        engine = engine or zero_offload.initialize(make_model(), cfg)
        return engine, _train(engine, steps)

    base = {"stage": 3, "stage3": {"unit_modules": ["Block3"], "live_budget_bytes": 30000},
            "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}
    cpu = {**base, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}}
    nvme = {**base, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"},
            "nvme_paths": [str(tmp_path)], "pinned_budget_bytes": 36 * ALIGN}  # sub-shards of 1024
    ref, want = run(cpu, range(5))
    want_sd = ref.consolidated_state_dict()
    ref.close()
    first, got = run(nvme, range(3))
    so = first.runtime.shard_optimizer
    assert any(len(p) > 1 for p in so.subshards.values()), "no unit was split: the test tests nothing"
    first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    resumed = zero_offload.initialize(make_model(), nvme)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    resumed, more = run(nvme, range(3, 5), resumed)
    got_sd = resumed.consolidated_state_dict()
    resumed.close()
    assert got + more == want
    for k in want_sd:
        assert torch.equal(got_sd[k], want_sd[k]), k
