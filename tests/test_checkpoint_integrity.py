"""Saving never removes what is not a checkpoint; loading finds a damaged checkpoint before it
writes anything (a review: a save deleted the user's `<path>.old` and `<path>.tmp`, and a save to
"" renamed the current directory away; a missing or truncated shard file, or a flipped digit in
the manifest, was found only once the load had begun, or not at all)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from test_checkpoint_checks import _engine, _same, _train, _weights
from zero_offload.engine.state.checkpoint import CheckpointError


def _saved(tmp_path: object) -> tuple[str, dict]:
    """A checkpoint of 2 steps at tmp_path/ck, and the weights it holds."""
    engine = _engine()
    _train(engine, range(2))
    path = str(tmp_path / "ck")
    engine.save_checkpoint(path)
    weights = _weights(engine)
    engine.close()
    return path, weights


@pytest.mark.parametrize("suffix", [".old", ".tmp"])
def test_save_leaves_a_users_old_or_tmp_directory_alone(tmp_path: object, suffix: str) -> None:
    engine = _engine()
    _train(engine, range(1))
    path = str(tmp_path / "ck")
    os.makedirs(path + suffix)
    open(os.path.join(path + suffix, "notes.txt"), "w").write("mine")
    with pytest.raises(CheckpointError, match=rf"ck{suffix} holds files and is not a checkpoint"):
        engine.save_checkpoint(path)
    assert open(os.path.join(path + suffix, "notes.txt")).read() == "mine"
    assert not os.path.exists(path)
    engine.close()


def test_save_replaces_its_own_leftovers_and_previous_checkpoint(tmp_path: object) -> None:
    engine = _engine()
    _train(engine, range(1))
    path = str(tmp_path / "ck")
    engine.save_checkpoint(path)
    os.rename(path, path + ".old")  # as a crash between the two renames leaves it
    engine.save_checkpoint(path + "2")
    os.rename(path + "2", path + ".tmp")  # a save's directory, as a crash before the manifest leaves it
    os.remove(os.path.join(path + ".tmp", "manifest.json"))
    _train(engine, range(1, 2))
    engine.save_checkpoint(path)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    engine.close()


@pytest.mark.parametrize("target", ["", ".", "..", None, 7])
def test_save_refuses_the_current_directory_and_non_paths(tmp_path: object, target: object,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    engine = _engine()
    _train(engine, range(1))
    with pytest.raises(CheckpointError, match="save_checkpoint: the path must be|is or holds the current directory") as info:
        engine.save_checkpoint(target)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert os.getcwd() == str(work) and os.listdir(tmp_path) == ["work"]
    engine.close()


def _damage_shard(path: str, how: str) -> None:
    name = os.path.join(path, sorted(f for f in os.listdir(path) if f.startswith("rank0.bucket"))[0])
    if how == "missing":
        os.remove(name)
    elif how == "empty":
        open(name, "wb").close()
    elif how == "truncated":
        data = open(name, "rb").read()
        open(name, "wb").write(data[: len(data) - 100])
    else:  # a directory in the file's place
        os.remove(name)
        os.makedirs(name)


@pytest.mark.parametrize("how, message", [("missing", "cannot be read: FileNotFoundError"),
                                          ("empty", "has 0 bytes, the manifest says"),
                                          ("truncated", "bytes, the manifest says"),
                                          ("directory", "is not a regular file")])
def test_a_missing_or_truncated_shard_file_is_refused_before_anything_changes(tmp_path: object, how: str,
                                                                              message: str) -> None:
    path, _ = _saved(tmp_path)
    _damage_shard(path, how)
    engine = _engine()
    _train(engine, range(1))
    before = _weights(engine)
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(path)
    assert engine.load_failed is None and _same(_weights(engine), before)
    _train(engine, range(1, 2))  # not stopped: nothing was written
    engine.close()


def test_a_flipped_digit_in_the_manifest_fails_its_checksum(tmp_path: object) -> None:
    path, _ = _saved(tmp_path)
    manifest = os.path.join(path, "manifest.json")
    text = open(manifest).read()
    assert '"global_steps": 2' in text
    open(manifest, "w").write(text.replace('"global_steps": 2', '"global_steps": 3'))
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"manifest.json fails its checksum"):
        engine.load_checkpoint(path)
    assert engine.load_failed is None
    engine.close()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("global_steps"), "global_steps is missing"),
    (lambda m: m.update(global_steps="2"), "global_steps is '2', expected a count"),
    (lambda m: m.update(world="1"), "world is '1', expected a positive integer"),
    (lambda m: m.update(precision="fp8"), "precision is 'fp8'"),
    (lambda m: m["optimizer"]["scaler"].pop("scale"), "optimizer.scaler is"),
    (lambda m: m["optimizer"]["steps"].update(bucket0=1.5), "optimizer.steps is"),
    (lambda m: m["optimizer"]["param_groups"][0].update(lr="fast"), "optimizer.param_groups is"),
])
def test_a_manifest_field_of_the_wrong_kind_is_refused_before_anything_changes(tmp_path: object, edit: object,
                                                                               message: str) -> None:
    """Checked field by field even without its checksum (a checkpoint saved before it existed)."""
    path, _ = _saved(tmp_path)
    os.remove(os.path.join(path, "manifest.crc32"))
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    edit(manifest)  # type: ignore[operator]
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    engine = _engine()
    with pytest.raises(CheckpointError, match=f"manifest.json: {message}"):
        engine.load_checkpoint(path)
    assert engine.load_failed is None
    engine.close()


def test_a_checkpoint_without_a_manifest_checksum_still_loads(tmp_path: object) -> None:
    path, weights = _saved(tmp_path)
    os.remove(os.path.join(path, "manifest.crc32"))
    engine = _engine()
    engine.load_checkpoint(path)
    assert _same(_weights(engine), weights)
    engine.close()


class _Tracked(torch.nn.Module):
    """A model with a buffer each rank updates from its own micro-batch (as BatchNorm's running
    statistics are), so the ranks' buffers differ and steer the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("stat", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.stat.mul_(0.5).add_(x.mean(0))
        return (self.lin(x) + self.stat).pow(2).mean()


def _rank_buffers_rank(rank: int, world: int, path: str) -> None:
    import zero_offload

    cfg = dict(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"})

    def steps(engine: object, rng: range) -> None:
        for i in rng:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + rank))
            engine.backward(engine(x))
            engine.step()

    whole = zero_offload.initialize(_Tracked(), cfg)
    steps(whole, range(2))
    whole.save_checkpoint(path)
    steps(whole, range(2, 4))
    resumed = zero_offload.initialize(_Tracked(), cfg)
    resumed.load_checkpoint(path)
    steps(resumed, range(2, 4))
    for (k, a), b in zip(whole.module.state_dict().items(), resumed.module.state_dict().values()):
        assert torch.equal(a, b), f"rank {rank}: {k} differs after resume"
    whole.close()
    resumed.close()


def test_resume_keeps_each_ranks_own_buffers(tmp_path: object) -> None:
    """Every rank's buffers are saved (model.pt holds rank 0's): the resumed run is bit-identical
    on every rank, not only on rank 0."""
    from _dist import run_ranks

    run_ranks(_rank_buffers_rank, 2, timeout=90, path=str(tmp_path / "ck"))


@pytest.mark.parametrize("saved, loaded", [(1, 3), (3, 1)])
def test_a_stage_change_with_frozen_parameters_is_refused_by_name(tmp_path: object, saved: int, loaded: int) -> None:
    """TinyLM's frozen gain lives in model.pt at stages 0-2 and in unit shards at stage 3; the
    load said the frozen shapes differ (they do not)."""
    import zero_offload
    from _engine_model import make_model

    def engine(stage: int) -> object:
        extra = {"stage3": {"unit_modules": ["TinyBlock"]}, "tiers": {"params": "cpu", "optimizer": "cpu",
                                                                        "grads": "cpu"}} if stage == 3 else {}
        return zero_offload.initialize(make_model(), dict(stage=stage, **extra))

    src = engine(saved)
    _train(src, range(1))
    src.save_checkpoint(str(tmp_path / "ck"))
    src.close()
    dst = engine(loaded)
    with pytest.raises(CheckpointError, match=rf"saved at stage {saved}, which keeps frozen parameters .* not "
                                              rf"supported: load it at stage"):
        dst.load_checkpoint(str(tmp_path / "ck"))
    assert dst.load_failed is None
    dst.close()


def _cwd_on_one_rank(rank: int, world: int, path: str) -> None:
    import zero_offload

    engine = zero_offload.initialize(_Tracked(), dict(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"}))
    engine.save_checkpoint(path)
    if rank == 1:
        os.chdir(path)  # only rank 1 works inside the checkpoint
    expected = "is or holds the current directory" if rank == 1 else "rank 1 will not save there"
    with pytest.raises(CheckpointError, match=expected):
        engine.save_checkpoint(path)
    engine.close()


def test_a_save_one_rank_refuses_is_refused_by_every_rank(tmp_path: object) -> None:
    """The current-directory check ran before the ranks agreed: rank 1 raised alone and rank 0
    waited in the agreement for ever (a review)."""
    from _dist import run_ranks

    run_ranks(_cwd_on_one_rank, 2, timeout=60, path=str(tmp_path / "ck"))
