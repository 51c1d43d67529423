"""`weights=` as large models ship: a Hugging Face index of safetensors (or torch) shards, or a
folder holding one; shards mapped lazily, a bounded number at a time; bad input in one line."""
from __future__ import annotations

import json
import os

import pytest
import torch

import zero_offload
from _stage3_model import make_model
from test_stage3_engine import _train
from zero_offload.engine.model import materialize
from zero_offload.engine.model.materialize import save_safetensors

CFG = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
       "stage3": {"unit_modules": ["Block3"], "live_budget_bytes": 30000},
       "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}
ST_INDEX, BIN_INDEX = "model.safetensors.index.json", "pytorch_model.bin.index.json"


def _state_dict() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in make_model().state_dict().items()}


def _shard_names(sd: dict[str, torch.Tensor], n: int) -> list[list[str]]:
    """The names in n runs, in module order (as Hugging Face splits a model)."""
    names = list(sd)
    step = -(-len(names) // n)
    return [names[i:i + step] for i in range(0, len(names), step)]


def write_shards(folder: str, sd: dict[str, torch.Tensor], n: int = 3, fmt: str = "safetensors") -> str:
    """`sd` as n shards plus an index, as Hugging Face writes them; returns the index's path."""
    os.makedirs(folder, exist_ok=True)
    ext, index_name = (".safetensors", ST_INDEX) if fmt == "safetensors" else (".bin", BIN_INDEX)
    weight_map = {}
    runs = _shard_names(sd, n)
    for i, names in enumerate(runs):
        shard = f"model-{i + 1:05d}-of-{len(runs):05d}{ext}"
        part = {k: sd[k] for k in names}
        save_safetensors(part, os.path.join(folder, shard)) if fmt == "safetensors" else \
            torch.save(part, os.path.join(folder, shard))
        weight_map.update({k: shard for k in names})
    index = os.path.join(folder, index_name)
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
                   "weight_map": weight_map}, f)
    return index


def _write_index(path: str, index: object) -> str:
    with open(path, "w") as f:
        json.dump(index, f)
    return path


def _meta_engine(weights: str) -> zero_offload.engine.engine.Engine:
    with torch.device("meta"):
        model = make_model()
    return zero_offload.initialize(model, CFG, weights=weights)


def _initial_and_trained(weights: str) -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    engine = _meta_engine(weights)
    try:
        initial = engine.consolidated_state_dict()
        losses = _train(engine, range(3))
        return initial, losses, engine.consolidated_state_dict()
    finally:
        engine.close()


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


# ---- loading ----
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("via", ["index", "folder"])
def test_sharded_weights_materialize_bit_for_bit_and_train_as_one_file(tmp_path: object, fmt: str, via: str) -> None:
    sd = _state_dict()
    index = write_shards(os.path.join(str(tmp_path), "sharded"), sd, fmt=fmt)
    single = os.path.join(str(tmp_path), "w.safetensors")
    save_safetensors(sd, single)
    initial, losses, trained = _initial_and_trained(index if via == "index" else os.path.dirname(index))
    _assert_equal(initial, sd)
    _, want_losses, want_trained = _initial_and_trained(single)
    assert losses == want_losses
    _assert_equal(trained, want_trained)


def test_folder_with_one_safetensors_file_or_one_state_dict(tmp_path: object) -> None:
    sd = _state_dict()
    for name in ("model.safetensors", "pytorch_model.bin"):
        folder = os.path.join(str(tmp_path), name.split(".")[0])
        os.makedirs(folder)
        save_safetensors(sd, os.path.join(folder, name)) if name.endswith("safetensors") else \
            torch.save(sd, os.path.join(folder, name))
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{}")  # what else a Hugging Face folder holds is ignored
        _assert_equal(dict(materialize.open_weights(folder)), sd)


def test_folder_with_both_formats_reads_safetensors(tmp_path: object) -> None:
    """A Hugging Face repository often ships the same weights twice; safetensors is preferred."""
    sd = _state_dict()
    folder = str(tmp_path)
    index = write_shards(folder, sd, n=2)
    other = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    write_shards(folder, other, n=2, fmt="bin")
    torch.save(other, os.path.join(folder, "training_args.bin"))
    w = materialize.open_weights(folder)
    assert getattr(w, "index", None) == index
    _assert_equal(dict(w), sd)


def test_shards_are_mapped_lazily_and_a_bounded_number_at_a_time(tmp_path: object) -> None:
    sd = _state_dict()
    index = write_shards(str(tmp_path), sd, n=3)
    w = materialize.open_weights(index)
    assert w.mapped_shards() == []
    assert len(w) == len(sd) and list(w) == list(sd) and all(k in w for k in sd) and "nope" not in w
    assert w.mapped_shards() == []  # `in`, len and iteration answer from the index alone
    for k in sd:
        assert torch.equal(w[k], sd[k])
        assert len(w.mapped_shards()) <= 2
    runs = _shard_names(sd, 3)
    assert [os.path.basename(p) for p in w.mapped_shards()] == ["model-00002-of-00003.safetensors",
                                                                "model-00003-of-00003.safetensors"]
    assert torch.equal(w[runs[0][0]], sd[runs[0][0]])  # a dropped shard is mapped again
    assert os.path.basename(w.mapped_shards()[-1]) == "model-00001-of-00003.safetensors"


# ---- bad input, one line each ----
def _one_line_error(weights: str, exc: type, match: str) -> None:
    """Through initialize (the user's view) and open_weights."""
    with pytest.raises(exc, match=match) as info:
        _meta_engine(weights)
    assert "\n" not in str(info.value)
    with pytest.raises(exc, match=match):
        materialize.open_weights(weights)


def test_index_naming_a_missing_shard_names_both(tmp_path: object) -> None:
    index = write_shards(str(tmp_path), _state_dict())
    os.remove(os.path.join(str(tmp_path), "model-00002-of-00003.safetensors"))
    _one_line_error(index, FileNotFoundError,
                    f"weights index {index} names shard model-00002-of-00003.safetensors, which does not exist")


def test_index_without_weight_map(tmp_path: object) -> None:
    index = _write_index(os.path.join(str(tmp_path), ST_INDEX), {"metadata": {}, "weights": {}})
    _one_line_error(index, ValueError, f"weights index {index} has no weight_map")
    index = _write_index(index, ["not", "an", "object"])
    _one_line_error(index, ValueError, f"weights index {index} has no weight_map")
    with open(index, "w") as f:
        f.write("{not json")
    _one_line_error(index, ValueError, f"weights index {index} is not JSON")


def test_name_in_weight_map_missing_from_its_shard(tmp_path: object) -> None:
    sd = _state_dict()
    index = write_shards(str(tmp_path), sd)
    with open(index) as f:
        wm = json.load(f)["weight_map"]
    wm["blocks.9.fc.weight"] = "model-00003-of-00003.safetensors"
    _write_index(index, {"weight_map": wm})
    _one_line_error(index, ValueError, f"weights index {index} maps 'blocks.9.fc.weight' to shard "
                                       "model-00003-of-00003.safetensors, which has no such tensor")


def test_path_that_is_neither_file_nor_folder(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "missing.safetensors")
    _one_line_error(path, FileNotFoundError, f"weights {path}: no such file or folder")


def test_unknown_extension_lists_the_accepted_formats(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "model.ckpt")
    torch.save(_state_dict(), path)  # even a loadable state dict: the name says nothing of its format
    _one_line_error(path, ValueError, r"unknown format; accepted: a \.safetensors file, a torch state dict")


def test_ambiguous_or_empty_folder(tmp_path: object) -> None:
    sd = _state_dict()
    two = os.path.join(str(tmp_path), "two")
    os.makedirs(two)
    save_safetensors(sd, os.path.join(two, "a.safetensors"))
    save_safetensors(sd, os.path.join(two, "b.safetensors"))
    _one_line_error(two, ValueError, f"weights folder {two} is ambiguous: it holds a.safetensors, b.safetensors")
    stray = os.path.join(str(tmp_path), "stray")
    write_shards(stray, sd, n=2)
    save_safetensors(sd, os.path.join(stray, "model.safetensors"))
    _one_line_error(stray, ValueError, f"weights folder {stray} is ambiguous: it holds {ST_INDEX}, model.safetensors")
    empty = os.path.join(str(tmp_path), "empty")
    os.makedirs(empty)
    _one_line_error(empty, FileNotFoundError, f"weights folder {empty} holds no weights; accepted:")


def test_shards_are_never_unpickled_beyond_tensors(tmp_path: object) -> None:
    """weights_only stays: a torch shard holding an arbitrary object is refused, not run."""
    sd = _state_dict()
    index = write_shards(str(tmp_path), sd, n=2, fmt="bin")
    shard = os.path.join(str(tmp_path), "model-00001-of-00002.bin")
    pwned = os.path.join(str(tmp_path), "pwned")
    torch.save({**torch.load(shard), "evil": _Evil(pwned)}, shard)
    with pytest.raises(Exception, match="refused: this file needs arbitrary code to load; it names io.open"):
        materialize.open_weights(index)
    assert not os.path.exists(pwned)


class _Evil:
    """Unpickling it would create a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def test_tensor_the_model_needs_but_the_index_lacks_is_named(tmp_path: object) -> None:
    """Tied weights are often left out of an index (head.weight here): fine; a missing 'pos' is not."""
    sd = {k: v for k, v in _state_dict().items() if k not in ("head.weight", "pos")}
    index = write_shards(str(tmp_path), sd)
    with pytest.raises(KeyError, match=f"weights file {index} has no tensor 'pos'"):
        _meta_engine(index)
