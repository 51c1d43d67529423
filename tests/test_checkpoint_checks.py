"""What a load checks before it changes anything, and what it does when it cannot: a review
found loads that silently took a mismatched or corrupted checkpoint, or stopped half way."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.engine.state.checkpoint import CheckpointError
from zero_offload.engine.engine import Engine, EngineStateError
from _engine_model import batch, make_model


def _engine(model: nn.Module | None = None, **cfg: object) -> Engine:
    base: dict = dict(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"}, bucket_bytes=4096)
    base.update(cfg)
    return zero_offload.initialize(model if model is not None else make_model(), base)


def _train(engine: Engine, steps: range, rows: int = 2) -> list[bool]:
    applied = []
    for s in steps:
        x, y = batch(s, rows)
        engine.backward(engine(x, y))
        applied.append(engine.step())
    return applied


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.consolidated_state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _flip_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_a_corrupt_shard_is_refused_before_anything_changes(tmp_path: object) -> None:
    """A flipped byte in the last shard file was found only once the load had overwritten the
    other shards: the engine then refused everything until some good checkpoint loaded. Now
    every file is verified first: refused, nothing changed, training goes on."""
    src = _engine()
    _train(src, range(3))
    src.save_checkpoint(str(tmp_path / "bad"))
    src.close()
    shards = sorted(f for f in os.listdir(tmp_path / "bad") if f.startswith("rank0.bucket"))
    assert len(shards) > 3, shards  # the corrupt one is read after others would have been written
    _flip_byte(str(tmp_path / "bad" / max(shards, key=lambda f: int(f.split("bucket")[1].split(".")[0]))))

    engine = _engine()
    _train(engine, range(1))
    before = _weights(engine)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        engine.load_checkpoint(str(tmp_path / "bad"))
    assert engine.load_failed is None and _same(_weights(engine), before)
    assert _train(engine, range(1, 2)) == [True]
    engine.close()


def test_an_io_failure_while_the_state_is_written_stops_the_engine_until_a_load_succeeds(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """What verification cannot foresee (the engine's own store failing part way through the
    apply) still leaves a mixture: every call refuses until a load succeeds."""
    src = _engine()
    _train(src, range(3))
    src.save_checkpoint(str(tmp_path / "good"))
    expected = _weights(src)
    _train(src, range(3, 5))
    continued = _weights(src)
    src.close()

    engine = _engine()
    opt = engine.runtime.shard_optimizer
    real, calls = opt.write_state, []

    def failing(key: str, parts: dict) -> None:
        calls.append(key)
        if len(calls) == 2:
            raise OSError(5, "Input/output error (simulated)")
        real(key, parts)
    monkeypatch.setattr(opt, "write_state", failing)
    with pytest.raises(OSError, match="Input/output error"):
        engine.load_checkpoint(str(tmp_path / "good"))
    monkeypatch.undo()
    for call in (lambda: engine(*batch(0, 2)), engine.step, lambda: engine.save_checkpoint(str(tmp_path / "x")),
                 engine.consolidated_state_dict):
        with pytest.raises(EngineStateError, match="last load_checkpoint stopped part way"):
            call()
    engine.load_checkpoint(str(tmp_path / "good"))
    assert _same(_weights(engine), expected)
    _train(engine, range(3, 5))
    assert _same(_weights(engine), continued)
    engine.close()


def test_mismatches_are_refused_before_anything_changes(tmp_path: object) -> None:
    class Model(nn.Module):
        def __init__(self, stat: torch.Tensor, frozen: str = "frozen") -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("stat", stat)
            setattr(self, frozen, nn.Parameter(torch.full((8,), 3.0), requires_grad=False))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    src = _engine(Model(torch.full((1,), 7.5)))
    src.save_checkpoint(str(tmp_path / "c"))
    src.close()
    cases = {"shape": Model(torch.zeros(8)), "dtype": Model(torch.zeros(1, dtype=torch.int64)),
             "name": Model(torch.zeros(1), frozen="frozen2")}
    for why, model in cases.items():
        engine = _engine(model)
        before = _weights(engine)
        with pytest.raises(CheckpointError, match="model.pt"):
            engine.load_checkpoint(str(tmp_path / "c"))
        assert _same(_weights(engine), before), why  # nothing was written, and the engine goes on
        engine.close()

    # A shard map edited by one element: the manifest's checksum of rank0.json catches it.
    src = _engine()
    _train(src, range(2))
    src.save_checkpoint(str(tmp_path / "m"))
    src.close()
    path = tmp_path / "m" / "rank0.json"
    maps = json.loads(path.read_text())
    key = next(iter(maps["shard_map"]))
    maps["shard_map"][key][0][2] += 1
    path.write_text(json.dumps(maps))
    engine = _engine()
    before = _weights(engine)
    with pytest.raises(CheckpointError, match="rank0.json fails its checksum"):
        engine.load_checkpoint(str(tmp_path / "m"))
    assert _same(_weights(engine), before)
    (tmp_path / "m" / "manifest.json").write_text("{\"format\": 1, \"wor")
    with pytest.raises(CheckpointError, match="checkpoint file .*manifest.json (fails its checksum|.*)"):
        engine.load_checkpoint(str(tmp_path / "m"))
    engine.close()


def test_rng_states_are_checksummed(tmp_path: object) -> None:
    src = _engine()
    src.save_checkpoint(str(tmp_path / "c"))
    src.close()
    _flip_byte(str(tmp_path / "c" / "rank0.rng.pt"))
    engine = _engine()
    with pytest.raises(CheckpointError, match="rank0.rng.pt"):
        engine.load_checkpoint(str(tmp_path / "c"))
    engine.close()


def test_accumulation_saves_only_at_a_boundary_and_a_load_starts_a_fresh_cycle(tmp_path: object) -> None:
    src = _engine(gradient_accumulation_steps=2)
    _train(src, range(3))
    with pytest.raises(EngineStateError, match="micro-batch 1 of 2 of a gradient-accumulation cycle"):
        src.save_checkpoint(str(tmp_path / "c"))
    _train(src, range(3, 4))
    src.save_checkpoint(str(tmp_path / "c"))
    _train(src, range(4, 8))
    expected = _weights(src)
    src.close()

    engine = _engine(gradient_accumulation_steps=2)
    _train(engine, range(1))  # a partial sum the load must forget
    engine.load_checkpoint(str(tmp_path / "c"))
    _train(engine, range(4, 8))
    assert _same(_weights(engine), expected)
    engine.close()

    engine = _engine(gradient_accumulation_steps=4)  # resumed with another accumulation: a whole first cycle
    engine.load_checkpoint(str(tmp_path / "c"))
    assert _train(engine, range(4, 8)) == [False, False, False, True]
    engine.close()


def test_a_loss_scale_loads_only_into_dynamic_fp16(tmp_path: object) -> None:
    fp16 = _engine(precision={"dtype": "fp16"})
    _train(fp16, range(2))
    assert fp16.runtime.shard_optimizer.scaler.scale > 1.0
    fp16.save_checkpoint(str(tmp_path / "c"))
    fp16.close()
    engine = _engine()
    engine.load_checkpoint(str(tmp_path / "c"))
    assert engine.runtime.shard_optimizer.scaler.scale == 1.0
    engine.close()
    static = _engine(precision={"dtype": "fp16", "static_scale": 128.0})
    static.load_checkpoint(str(tmp_path / "c"))
    assert static.runtime.shard_optimizer.scaler.scale == 128.0
    static.close()


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path: object) -> None:
    target = tmp_path / "run"
    (target / "logs").mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    engine = _engine()
    with pytest.raises(CheckpointError, match="holds files and is not a checkpoint"):
        engine.save_checkpoint(str(target))
    assert (target / "notes.txt").read_text() == "keep me" and (target / "logs").is_dir()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.save_checkpoint(str(tmp_path / "ckpt"))  # a checkpoint is replaced, as before
    engine.close()


def _refused_on_one_rank(rank: int, world: int, tmp: str, phase: str) -> None:
    engine = _engine()
    _train(engine, range(2))
    engine.save_checkpoint(os.path.join(tmp, "c"))
    before = _weights(engine)
    if rank == 0:
        victim = "rank1.rng.pt" if phase == "check" else "rank1.bucket0.pt"
        _flip_byte(os.path.join(tmp, "c", victim))
    import torch.distributed as dist

    dist.barrier()
    with pytest.raises(CheckpointError, match="rank 1 (refused the checkpoint|failed part way)"
                       if rank == 0 else "rank1"):
        engine.load_checkpoint(os.path.join(tmp, "c"))
    # Nothing changed anywhere: training goes on. A shard file's damage ("write") used to be
    # found only once the state was being written, and both ranks then refused to go on.
    assert engine.load_failed is None
    assert _same(_weights(engine), before)  # a collective: {} on rank 1
    _train(engine, range(2, 3))
    engine.close()


@pytest.mark.parametrize("phase", ["check", "write"])
def test_a_checkpoint_one_rank_refuses_is_refused_by_every_rank(tmp_path: object, phase: str) -> None:
    """Each rank reads its own files; one rank's refusal used to leave the other writing its
    state and waiting for ever in the load's all-gather (a review's finding)."""
    from _dist import run_ranks

    run_ranks(_refused_on_one_rank, 2, timeout=120, tmp=str(tmp_path), phase=phase)


def test_sub_shard_step_counts_survive_a_save(tmp_path: object) -> None:
    from zero_offload.config import Config
    from zero_offload.engine.step.shard_optimizer import ShardOptimizer

    def config(name: str) -> Config:
        os.makedirs(os.path.join(str(tmp_path), name))
        return Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"},
                      nvme_paths=(os.path.join(str(tmp_path), name),), pinned_budget_bytes=36 * 1024 * 4)
    opt = ShardOptimizer(config("a"), torch.device("cpu"), capacity_bytes=1 << 22)
    opt.add_shard("s", torch.zeros(8192))
    opt.sub_steps.update({"s#0": 3, "s#1": 2})  # as after a step that failed in its second part
    opt.steps["s"] = 2
    again = ShardOptimizer(config("b"), torch.device("cpu"), capacity_bytes=1 << 22)
    again.add_shard("s", torch.zeros(8192))
    again.load_scalars(opt.state_dict_scalars())
    assert again.sub_steps == {"s#0": 3, "s#1": 2} and again.steps == {"s": 2}
    opt.close()
    again.close()


def _save_fails_on_one_rank(rank: int, world: int, tmp: str) -> None:
    from zero_offload.engine.state import files

    engine = _engine()
    _train(engine, range(2))
    engine.save_checkpoint(os.path.join(tmp, "c"))
    saved = _weights(engine)
    _train(engine, range(2, 3))
    real = files.save_tensors

    def disk_full(tensors: dict, path: str) -> dict:
        if rank == 1 and ".bucket" in path:
            raise OSError(28, "No space left on device")
        return real(tensors, path)
    files.save_tensors = disk_full
    with pytest.raises((CheckpointError, OSError), match="rank 1 could not write its part|No space left"):
        engine.save_checkpoint(os.path.join(tmp, "c"))
    files.save_tensors = real
    engine.load_checkpoint(os.path.join(tmp, "c"))  # the previous checkpoint, whole
    assert _same(_weights(engine), saved)
    engine.close()


def test_a_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path: object) -> None:
    """Rank 1 cannot write a shard file: rank 0 used to go on, finish a manifest without it and
    wait for ever in the last barrier; now both raise and the previous checkpoint stays."""
    from _dist import run_ranks

    run_ranks(_save_fails_on_one_rank, 2, timeout=120, tmp=str(tmp_path))


def _scheduled(engine: Engine) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(engine.optimizer, T_max=6)


def test_client_state_resumes_a_scheduler_as_if_never_stopped(tmp_path: object) -> None:
    """save_checkpoint had no client_state: a loop's LR scheduler (and data position) had to be
    saved beside the checkpoint by hand, outside its atomic swap. Now rank 0's dict is saved in
    it, checked on load and returned; the resumed run equals the uninterrupted one."""
    straight = _engine()
    sched = _scheduled(straight)
    for s in range(4):
        _train(straight, range(s, s + 1))
        sched.step()
    first = _engine()
    sched = _scheduled(first)
    for s in range(2):
        _train(first, range(s, s + 1))
        sched.step()
    ckpt = os.path.join(str(tmp_path), "ckpt")
    first.save_checkpoint(ckpt, client_state={"scheduler": sched.state_dict(), "next_batch": 2, 7: (1, 2.5),
                                              "seen": torch.arange(3)})
    first.close()
    resumed = _engine()
    sched = _scheduled(resumed)
    state = resumed.load_checkpoint(ckpt)
    assert state["next_batch"] == 2 and state[7] == (1, 2.5) and torch.equal(state["seen"], torch.arange(3))
    sched.load_state_dict(state["scheduler"])
    for s in range(state["next_batch"], 4):
        _train(resumed, range(s, s + 1))
        sched.step()
    assert resumed.optimizer.param_groups[0]["lr"] == straight.optimizer.param_groups[0]["lr"]
    assert _same(_weights(resumed), _weights(straight))
    resumed.save_checkpoint(ckpt)  # without client_state: a load returns None
    assert resumed.load_checkpoint(ckpt) is None
    straight.close()
    resumed.close()


class _Position:
    """Picklable, but a weights-only load refuses it."""


@pytest.mark.parametrize("state,why", [({"f": lambda s: s}, "Can't pickle"),
                                       ({"pos": _Position()}, "Unsupported global"),
                                       ([1, 2], "client_state must be a dict, got list")])
def test_a_client_state_that_would_not_load_is_refused_before_anything_is_written(
        state: object, why: str, tmp_path: object) -> None:
    engine = _engine()
    _train(engine, range(1))
    ckpt = os.path.join(str(tmp_path), "ckpt")
    engine.save_checkpoint(ckpt, client_state={"ok": 1})
    with pytest.raises(CheckpointError, match=f"save_checkpoint: .*{why}"):
        engine.save_checkpoint(ckpt, client_state=state)
    assert not os.path.exists(ckpt + ".tmp") and engine.load_checkpoint(ckpt) == {"ok": 1}
    engine.close()


def test_a_damaged_client_state_file_is_refused_before_the_load_changes_anything(tmp_path: object) -> None:
    engine = _engine()
    _train(engine, range(1))
    ckpt = os.path.join(str(tmp_path), "ckpt")
    engine.save_checkpoint(ckpt, client_state={"epoch": 1})
    before = _weights(engine)
    _train(engine, range(1, 2))
    after = _weights(engine)
    with open(os.path.join(ckpt, "client_state.pt"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(CheckpointError, match="client_state.pt: its size or checksum differs from the manifest"):
        engine.load_checkpoint(ckpt)
    assert _same(_weights(engine), after) and not _same(after, before)
    assert _train(engine, range(2, 3)) == [True]  # refused before it changed anything: training goes on
    engine.close()
