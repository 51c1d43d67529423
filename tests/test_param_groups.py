"""Parameter groups (initialize(..., param_groups=...)): per-group lr, betas and weight decay.

Checked against torch.optim.AdamW with the same groups on the single-process reference: every
stage and optimizer tier at D = 1 (shards that hold both groups; at stage 3 on nvme, sub-shards
that cross a group boundary), stages 2 and 3 at D = 2 (a group's run crosses the ranks' shard
boundary), a per-group LR schedule, a resume, and the one-line errors for groups that cannot be
right.
"""
from __future__ import annotations

import tempfile

import pytest
import torch

from _dist import run_ranks

from test_engine_matrix import LR, ROWS_PER_RANK  # its train() runs these rows per rank

STEPS = 6
# Group 0: matrices and the embedding, decayed; group 1: biases and norms, not decayed, with their
# own lr and betas (the usual recipe, made visible), and the attention output projections, so that
# a bucket of larger buckets holds both groups.
HYPER = [{"weight_decay": 0.1}, {"weight_decay": 0.0, "lr": 2e-2, "betas": (0.8, 0.99)}]


def _group(name: str) -> int:
    """Group of a TinyLM parameter by its name."""
    from _engine_model import make_model

    dims = {n: p.dim() for n, p in make_model().named_parameters(remove_duplicate=False)}
    return 1 if dims[name] < 2 or name.endswith("proj.weight") else 0


def engine_groups(model: torch.nn.Module) -> list[dict]:
    """The groups as a user writes them: group 0 by parameter objects (with a tied alias named
    too), group 1 by name (with the frozen parameter, which is skipped)."""
    matrices = [p for n, p in model.named_parameters() if _group(n) == 0] + ["head.weight"]
    vectors = [n for n, p in model.named_parameters() if _group(n) == 1]
    return [{"params": matrices, **HYPER[0]}, {"params": vectors, "name": "no_decay", **HYPER[1]}]


def _config(stage: int, tier: str, nvme_dir: str, pinned: int = 100_000, bucket: int = 6000) -> dict:
    cfg = dict(stage=stage, tiers={"optimizer": tier, "grads": tier}, optimizer={"lr": LR, "weight_decay": 0.01},
               bucket_bytes=bucket, pinned_budget_bytes=pinned, nvme_paths=[nvme_dir] if tier == "nvme" else [])
    if stage == 3:
        cfg["stage3"] = {"unit_modules": ["TinyBlock"]}
        cfg["tiers"]["params"] = tier
    return cfg


def _train(cfg: dict, world: int, rank: int, schedule=None) -> tuple[list[float], dict]:
    from test_engine_matrix import train

    losses, weights, engine = train(cfg, STEPS, world, rank, groups=engine_groups, schedule=schedule)
    engine.close()
    return losses, weights


def _check(tag: str, got: tuple[list[float], dict], ref: tuple[list[float], dict]) -> None:
    from test_engine_matrix import TOL, compare

    compare(tag, *got, *ref, TOL["fp32"])


def _reference(world: int, schedule=None) -> tuple[list[float], dict]:
    from _engine_model import reference_run

    return reference_run(STEPS, ROWS_PER_RANK * world, torch.float32, lr=LR, wd=0.01,
                         groups=(_group, HYPER), schedule=schedule)


def _matrix_rank(rank: int, world: int, combos: list[tuple[int, str, int, int]]) -> None:
    ref = _reference(world)
    plain = _reference_without_groups(world)
    with tempfile.TemporaryDirectory() as nvme_dir:
        for stage, tier, pinned, bucket in combos:
            got = _train(_config(stage, tier, nvme_dir, pinned, bucket), world, rank)
            if rank == 0:
                tag = f"D={world} stage={stage} tier={tier} pinned={pinned} bucket={bucket}"
                _check(tag, got, ref)
                # the groups did something: the reference without them is far off
                assert max(float((got[1][k] - v).abs().max()) for k, v in plain[1].items()) > 1e-3, tag


def _reference_without_groups(world: int) -> tuple[list[float], dict]:
    from _engine_model import reference_run

    return reference_run(STEPS, ROWS_PER_RANK * world, torch.float32, lr=LR, wd=0.01)


def _nvme() -> list[str]:
    try:
        import zero_offload.io.swap  # noqa: F401
    except ImportError:
        return []
    return ["nvme"]


def test_groups_match_adamw_every_stage_and_tier() -> None:
    tiers = ["device", "cpu"] + _nvme()
    # Every stage and every tier, not every pair (the groups live in the shard optimizer, which
    # stages and tiers share; CI time): the tier rotates with the stage, and stage 3 runs all.
    combos = [(stage, tiers[stage % len(tiers)], 100_000, 6000) for stage in (0, 1, 2)]
    combos += [(3, tier, 100_000, 6000) for tier in tiers]
    # 20 kB buckets hold both groups; at stage 3 every unit's shard does, and on nvme its
    # sub-shards (this staging budget splits each unit's shard in five) cross group boundaries.
    combos += [(1, tier, 100_000, 20000) for tier in tiers[1:]]
    run_ranks(_matrix_rank, 1, timeout=240, combos=combos)


def test_groups_match_adamw_across_ranks() -> None:
    run_ranks(_matrix_rank, 2, timeout=240, combos=[(2, "cpu", 100_000, 20000), (3, "cpu", 100_000, 6000)])


def _halving(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Group 0 constant, group 1 halved every step: a schedule that tells the groups apart."""
    return torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5 ** s])


def _schedule_rank(rank: int, world: int) -> None:
    with tempfile.TemporaryDirectory() as nvme_dir:
        got = _train(_config(1, "cpu", nvme_dir), world, rank, schedule=_halving)
    _check("LambdaLR per group", got, _reference(world, schedule=_halving))


def test_per_group_lr_schedule() -> None:
    run_ranks(_schedule_rank, 1, timeout=120)


def test_optimizer_exposes_one_param_group_per_group() -> None:
    import zero_offload
    from _engine_model import make_model

    model = make_model()
    engine = zero_offload.initialize(model, _config(1, "cpu", ""), param_groups=engine_groups(model))
    try:
        groups = engine.optimizer.param_groups
        assert [(g["lr"], g["weight_decay"], g["betas"]) for g in groups] == [
            (LR, 0.1, (0.9, 0.999)), (2e-2, 0.0, (0.8, 0.99))]
        assert groups[1]["name"] == "no_decay"
    finally:
        engine.close()


def _resume_rank(rank: int, world: int) -> None:
    import zero_offload
    from zero_offload.engine.state.checkpoint import CheckpointError
    from _engine_model import batch, make_model

    def step(engine: object, i: int) -> float:
        x, y = batch(i, ROWS_PER_RANK)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss)

    with tempfile.TemporaryDirectory() as d:
        cfg = _config(2, "nvme" if _nvme() else "cpu", d)
        model = make_model()
        whole = zero_offload.initialize(model, cfg, param_groups=engine_groups(model))
        losses = [step(whole, i) for i in range(3)]
        whole.optimizer.param_groups[1]["lr"] = 5e-3  # as a scheduler would: the checkpoint keeps it
        whole.save_checkpoint(f"{d}/ckpt")
        losses += [step(whole, i) for i in range(3, 6)]
        final = whole.consolidated_state_dict()
        whole.close()

        model = make_model(seed=7)
        resumed = zero_offload.initialize(model, cfg, param_groups=engine_groups(model))
        resumed.load_checkpoint(f"{d}/ckpt")
        assert resumed.optimizer.param_groups[1]["lr"] == 5e-3
        tail = [step(resumed, i) for i in range(3, 6)]
        assert tail == losses[3:]
        for k, v in resumed.consolidated_state_dict().items():
            assert torch.equal(v, final[k]), k
        resumed.close()

        ungrouped = zero_offload.initialize(make_model(), cfg)
        try:
            with pytest.raises(CheckpointError, match="has 2 parameter group"):
                ungrouped.load_checkpoint(f"{d}/ckpt")
        finally:
            ungrouped.close()


def test_resume_with_groups_is_bit_identical() -> None:
    run_ranks(_resume_rank, 1, timeout=120)


@pytest.mark.parametrize("groups, message", [
    ("weights", r"param_groups: expected a non-empty list of dicts"),
    ([], r"param_groups: expected a non-empty list of dicts"),
    ([{"lr": 1.0}], r"param_groups\[0\]: expected a dict with a 'params' entry"),
    ([{"params": "tok.weight"}], r"param_groups\[0\]\['params'\]: expected a list of parameters"),
    ([{"params": ["nope"]}], r"param_groups\[0\]: the model has no parameter named 'nope'"),
    ([{"params": [torch.nn.Parameter(torch.zeros(3))]}], r"param_groups\[0\]: a tensor of shape \(3,\) that is not"),
    ([{"params": [1]}], r"param_groups\[0\]: expected parameters or names, got int"),
    ([{"params": ["all"], "momentum": 0.9}], r"param_groups\[0\]: unknown key\(s\) \['momentum'\]"),
    ([{"params": ["all"], "weight_decay": -1.0}], r"param_groups\[0\]: .*weight_decay"),
    ([{"params": ["all"], "betas": (0.9, 1.0)}], r"param_groups\[0\]: .*betas"),
    ([{"params": ["all"]}, {"params": ["tok.weight"]}], r"param_groups\[1\]: parameter 'tok.weight' is already in"),
    ([{"params": ["tok.weight"]}], r"param_groups: \d+ trainable parameter\(s\) are in no group"),
])
def test_bad_groups_are_refused_in_one_line(groups: object, message: str) -> None:
    import zero_offload
    from zero_offload.config import ConfigError
    from _engine_model import make_model

    model = make_model()
    if isinstance(groups, list):
        groups = [{**g, "params": [n for n, _ in model.named_parameters()]} if g.get("params") == ["all"] else g
                  for g in groups]
    with pytest.raises(ConfigError, match=message) as info:
        zero_offload.initialize(model, _config(1, "cpu", ""), param_groups=groups)
    assert "\n" not in str(info.value)
