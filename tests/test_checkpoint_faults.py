"""A refused checkpoint leaves the engine exactly as it was (the faults issue): a corrupt file was
found only while the load was overwriting the state, which then stayed a mixture, every call
refusing until some good checkpoint loaded; a byte flipped in a file's header (offset 60) loaded
without complaint; shards at different steps loaded as one state; a refused pickle showed torch's
text, whose first line advises weights_only=False.

At stages 0-3 (stage 2 with the optimizer on NVMe, stage 3 with parameters and optimizer there):
each kind of damage is refused in one line, the weights, moments, step counts and RNG are bit
identical to before, and a further step equals that of an engine that never tried the load."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from typing import Any, Callable

import pytest
import torch

import zero_offload
from _engine_model import batch, make_model
from zero_offload.engine.state import manifest_checks
from zero_offload.engine.state.checkpoint import CheckpointError
from zero_offload.engine.engine import Engine
from zero_offload.io import checksum

UNITS = {"unit_modules": ["TinyBlock"]}


def _config(stage: int, nvme: str) -> dict:
    tiers = {0: {"optimizer": "cpu", "grads": "cpu"}, 1: {"optimizer": "cpu", "grads": "cpu"},
             2: {"optimizer": "nvme", "grads": "cpu"}, 3: {"params": "nvme", "optimizer": "nvme", "grads": "cpu"}}
    cfg: dict = dict(stage=stage, tiers=tiers[stage], bucket_bytes=4096, nvme_paths=[nvme] if stage >= 2 else [])
    return {**cfg, "stage3": UNITS} if stage == 3 else cfg


def _engine(stage: int, nvme: str) -> Engine:
    os.makedirs(nvme, exist_ok=True)
    return zero_offload.initialize(make_model(), _config(stage, nvme))


def _train(engine: Engine, steps: range) -> None:
    for s in steps:
        x, y = batch(s, 2)
        engine.backward(engine(x, y))
        engine.step()


def _state(engine: Engine) -> dict[str, Any]:
    """Everything a load writes: weights (consolidated, a collective), every shard's master and
    moments, frozen shards, step counts and lagging ranges, counters, the RNG."""
    rt, opt = engine.runtime, engine.runtime.shard_optimizer
    return {"weights": engine.consolidated_state_dict(),
            "shards": {k: {p: t.clone() for p, t in opt.read_state(k).items()} for k in rt.shard_map()},
            "frozen": {k: rt.read_frozen(k).clone() for k in rt.frozen_map()},
            "steps": (dict(opt.steps), dict(opt.sub_steps), opt.lagging(rt.shard_map()), opt.skipped_steps),
            "counters": (engine.global_steps, engine.micro_step), "rng": torch.get_rng_state(),
            "buffers": {k: v.clone() for k, v in engine.module.named_buffers()}}


def _differs(a: Any, b: Any, at: str = "") -> str | None:
    """Where two states differ (bit for bit), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return None if same else at
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{at} keys"
        return next((d for k in a if (d := _differs(a[k], b[k], f"{at}/{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _differs(x, y, f"{at}[{i}]")) is not None), None)
    return None if a == b else at


# ---- damage, each to a copy of a good checkpoint ----
def _flip(path: str, offset: int | None = None) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _last_shard(ck: str) -> str:
    """The shard file a load writes last (so a load that checks as it goes has overwritten the rest)."""
    maps = json.load(open(os.path.join(ck, "rank0.json")))
    return os.path.join(ck, f"rank0.{list(maps['shard_map'])[-1]}.pt")


def _edit_manifest(ck: str, edit: Callable[[dict], None]) -> None:
    """Edit manifest.json and write its checksum anew (a consistent manifest that lies)."""
    manifest = json.load(open(os.path.join(ck, "manifest.json")))
    edit(manifest)
    raw = json.dumps(manifest).encode()
    open(os.path.join(ck, "manifest.json"), "wb").write(raw)
    manifest_checks.write_crc(ck, raw)


def _edit_shape(ck: str) -> None:
    name = os.path.basename(_last_shard(ck))

    def edit(m: dict) -> None:
        m["files"][name]["m"]["shape"] = [m["files"][name]["m"]["shape"][0] - 1]
    _edit_manifest(ck, edit)


def _mixed_steps(ck: str) -> None:
    def edit(m: dict) -> None:
        first = next(iter(m["optimizer"]["steps"]))  # one bucket or unit a step ahead of the rest
        m["optimizer"]["steps"][first] += 1
        if first in m["optimizer"].get("sub_steps", {}):
            m["optimizer"]["sub_steps"][first] += 1
    _edit_manifest(ck, edit)


DAMAGE: dict[str, tuple[Callable[[str], None], str]] = {
    "a data byte of the last shard file": (lambda ck: _flip(_last_shard(ck)), "fails its checksum"),
    "a header byte (offset 60) of the last shard file": (lambda ck: _flip(_last_shard(ck), 60), "fails its checksum"),
    "a header byte (offset 60) of model.pt": (lambda ck: _flip(os.path.join(ck, "model.pt"), 60), "fails its checksum"),
    "a byte of rank0.rng.pt": (lambda ck: _flip(os.path.join(ck, "rank0.rng.pt")), "rank0.rng.pt"),
    "a shape edited in the manifest, its CRC recomputed": (_edit_shape, "shape, dtype or checksum differs"),
    "shards at different steps, the CRC recomputed": (_mixed_steps, "shards are at different steps"),
}


def _refusals(engine: Engine, good: str, work: str) -> list[str]:
    """Each damage on a fresh copy of `good`, loaded into `engine`: what went wrong, if anything."""
    problems = []
    before = _state(engine)
    for i, (what, (damage, message)) in enumerate(DAMAGE.items()):
        ck = os.path.join(work, f"bad{i}")
        shutil.copytree(good, ck)
        damage(ck)
        try:
            engine.load_checkpoint(ck)
            problems.append(f"{what}: loaded")
        except Exception as exc:
            text = str(exc)
            if message not in text or "\n" in text or not isinstance(exc, CheckpointError):
                problems.append(f"{what}: {type(exc).__name__}: {text[:200]!r}")
        try:
            where = _differs(before, _state(engine))
        except Exception as exc:  # the engine refuses even to report its state
            where = f"{type(exc).__name__}: {str(exc)[:120]}"
        if where is not None or engine.load_failed is not None:
            problems.append(f"{what}: the engine changed ({where}; load_failed={engine.load_failed})")
    return problems


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_refused_load_leaves_the_engine_as_it_was(stage: int, tmp_path: Any) -> None:
    engine, never = _engine(stage, str(tmp_path / "a")), _engine(stage, str(tmp_path / "b"))
    for e in (engine, never):
        _train(e, range(2))
    engine.save_checkpoint(str(tmp_path / "good"))
    for e in (engine, never):
        _train(e, range(2, 3))
    problems = _refusals(engine, str(tmp_path / "good"), str(tmp_path))
    assert not problems, problems
    for e in (engine, never):
        _train(e, range(3, 4))
    assert _differs(_state(never), _state(engine)) is None  # trainable as it was
    engine.load_checkpoint(str(tmp_path / "good"))  # the undamaged checkpoint still loads
    assert engine.global_steps == 2
    engine.close()
    never.close()


def test_a_format_1_checkpoint_is_verified_per_tensor_before_anything_changes(tmp_path: Any) -> None:
    """Checkpoints saved before whole-file checksums: their tensors are checked (CRC32 each) in
    the verify pass, so a flipped data byte is refused with nothing changed; they still load."""
    engine = _engine(1, str(tmp_path / "a"))
    _train(engine, range(2))
    good = str(tmp_path / "good")
    engine.save_checkpoint(good)

    def to_format_1(m: dict) -> None:
        m["format"] = 1
        m.pop("checksums", None)
    _edit_manifest(good, to_format_1)
    _train(engine, range(2, 3))
    before = _state(engine)
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    _flip(_last_shard(bad))
    with pytest.raises(CheckpointError, match="differs from the manifest"):
        engine.load_checkpoint(bad)
    assert _differs(before, _state(engine)) is None and engine.load_failed is None
    engine.load_checkpoint(good)
    assert engine.global_steps == 2
    engine.close()


def _one_rank_damaged(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    engine = _engine(1, os.path.join(tmp, f"a{rank}"))
    _train(engine, range(2))
    ck = os.path.join(tmp, "c")
    engine.save_checkpoint(ck)
    _train(engine, range(2, 3))
    before = _state(engine)
    if rank == 0:  # rank 1's own last shard file, which only rank 1 reads
        maps = json.load(open(os.path.join(ck, "rank1.json")))
        _flip(os.path.join(ck, f"rank1.{list(maps['shard_map'])[-1]}.pt"))
    dist.barrier()
    with pytest.raises(CheckpointError, match="rank 1 refused the checkpoint" if rank == 0 else "fails its checksum"):
        engine.load_checkpoint(ck)
    assert _differs(before, _state(engine)) is None and engine.load_failed is None
    _train(engine, range(3, 4))  # both ranks go on together: neither was left in a collective
    engine.close()


def test_damage_to_one_ranks_file_is_refused_by_both_ranks(tmp_path: Any) -> None:
    from _dist import run_ranks

    run_ranks(_one_rank_damaged, 2, timeout=150, tmp=str(tmp_path))


# ---- pickles a weights-only load refuses ----
class _Hostile:
    """Unpickling it would run a shell command."""

    def __reduce__(self) -> tuple:
        return (os.system, ("echo this should never run",))


def _our_refusal(text: str) -> None:
    assert "refused: this file needs arbitrary code to load" in text, text
    assert "weights_only" not in text and "\n" not in text, text


def test_a_hostile_pickle_in_weights_is_our_one_line(tmp_path: Any) -> None:
    sd: dict[str, Any] = dict(make_model().state_dict())
    sd["payload"] = _Hostile()
    path = str(tmp_path / "w.pt")
    torch.save(sd, path)
    with torch.device("meta"):
        model = make_model()
    cfg = {"stage": 3, "stage3": UNITS, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}}
    with pytest.raises(Exception) as info:
        zero_offload.initialize(model, cfg, weights=path)
    assert not isinstance(info.value, pickle.UnpicklingError)
    _our_refusal(str(info.value))


def test_a_hostile_pickle_in_a_checkpoint_is_our_one_line(tmp_path: Any) -> None:
    """In client_state.pt, and in a tensor file, each with the manifest's sizes and checksums
    made to match: refused in our words, the engine unchanged."""
    engine = _engine(1, str(tmp_path / "a"))
    _train(engine, range(1))
    good = str(tmp_path / "good")
    engine.save_checkpoint(good, client_state={"epoch": 1})
    _train(engine, range(1, 2))
    before = _state(engine)
    for name in ("client_state.pt", "model.pt"):
        ck = str(tmp_path / name)
        shutil.copytree(good, ck)
        torch.save({"payload": _Hostile()}, os.path.join(ck, name))
        data = open(os.path.join(ck, name), "rb").read()

        def match(m: dict) -> None:
            if name == "client_state.pt":
                m["client_state"] = {"size": len(data), "crc32": zlib.crc32(data)}
            else:
                m["sizes"][name] = len(data)
                m["checksums"]["files"][name] = checksum.file_checksum(os.path.join(ck, name))
        _edit_manifest(ck, match)
        with pytest.raises(CheckpointError) as info:
            engine.load_checkpoint(ck)
        _our_refusal(str(info.value))
        assert name in str(info.value)
        assert _differs(before, _state(engine)) is None
    engine.close()


def test_a_whole_file_checksum_does_not_depend_on_how_its_bytes_arrive(tmp_path: Any) -> None:
    """torch.save hands the writer records of any size, a reader reads whole blocks: both must
    give the same value, and one flipped bit anywhere (a header byte) another."""
    data = os.urandom(2 * checksum.FILE_CHUNK + 4321)
    whole = checksum.FileChecksum()
    whole.update(data)
    pieces, at, sizes = checksum.FileChecksum(), 0, [1, 60, 4096, checksum.FILE_CHUNK + 7, 3 << 20]
    for i in range(10 ** 6):
        if at >= len(data):
            break
        n = sizes[i % len(sizes)]
        pieces.update(memoryview(data)[at:at + n])
        at += n
    path = str(tmp_path / "f")
    open(path, "wb").write(data)
    assert whole.digest() == pieces.digest() == checksum.file_checksum(path)
    _flip(path, 60)
    assert checksum.file_checksum(path) != whole.digest()
