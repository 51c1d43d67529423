"""The files a meta model's weights come from (`weights=`), read lazily through mmap.

Accepted: one .safetensors file (read by the safetensors package's `safe_open`, imported only
when such a file is used: every dtype it and torch both know); one torch state dict (.bin, .pt, .pth: `torch.load` with
weights_only=True, so nothing but tensors is ever unpickled, and mmap=True, so nothing is read up
front); a Hugging Face index of shards (*.safetensors.index.json or *.bin.index.json: its
"weight_map" maps each tensor name to a shard file in the index's folder); or a folder holding
exactly one of these (see pick_in_folder).

The result is a name -> tensor Mapping whose tensors are views of memory-mapped files: a tensor's
bytes are read when the unit that needs it copies them. An index gives a ShardedWeights, which
answers `in`, `len` and iteration from the weight_map alone and maps a shard only when one of its
tensors is asked for, keeping the OPEN_SHARDS most recently used mapped (units are filled in module
order, the order Hugging Face writes shards in, so each shard is mapped about once). A tensor
handed out keeps its shard's mapping alive until it is dropped; the filler copies it at once.
Mapped pages are clean file pages the kernel may drop under pressure, so a model larger than RAM
still loads unit by unit.

`weights=` may also be a WeightSource: weights whose names or layout on disk differ from the
module's (a checkpoint converted at load time, zero_offload.hf.from_pretrained's source), each
tensor produced on request in the module's name and layout. The core reads it through the same
Mapping (SourceWeights), one tensor at a time in unit order, and never imports what implements it.
"""
from __future__ import annotations

import json
import os
import pickle
import re
from collections import OrderedDict
from typing import Any, Callable, Collection, Iterator, Mapping, Protocol, Union, runtime_checkable

import torch

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
ACCEPTED = ("a .safetensors file, a torch state dict (.bin, .pt, .pth), a Hugging Face index of shards "
            "(*.safetensors.index.json, *.bin.index.json), or a folder holding one of these")
OPEN_SHARDS = 2  # shards mapped at once: the one being read, and the previous one (a tensor tied across)


@runtime_checkable
class WeightSource(Protocol):
    """Weights produced on request in the module's names and layout (see the module docstring).
    `where`: what error messages name (the folder read); `names()`: every parameter and buffer
    name it can produce; `read(name)`: that tensor (any dtype; the filler copies it at once), for
    the names of one unit at a time, in module order, so a source holds no more than one unit.
    A source may also set `init_missing = True`: a tensor it does not name is then initialized
    by the model's own initialization (as transformers' loader does) instead of refused."""

    where: str

    def names(self) -> Collection[str]: ...

    def read(self, name: str) -> torch.Tensor: ...


class SourceWeights(Mapping[str, torch.Tensor]):
    """A WeightSource as the name -> tensor Mapping the filler and the meta buffers read."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self._names = source.names()
        self.init_missing = bool(getattr(source, "init_missing", False))  # see WeightSource

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self.source.read(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


Weights = Union[str, os.PathLike, WeightSource, None]  # what `weights=` takes


def open_source(weights: Weights) -> tuple[Mapping[str, torch.Tensor] | None, str]:
    """`weights=` as (the lazy Mapping, what error messages name it), or (None, "") for none."""
    if isinstance(weights, WeightSource):
        return SourceWeights(weights), weights.where
    if not weights:
        return None, ""
    return open_weights(weights), os.fspath(weights)


def open_weights(path: str | os.PathLike) -> Mapping[str, torch.Tensor]:
    """The tensors `weights=` names, as a lazy Mapping (see the module docstring)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = pick_in_folder(path)
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"weights {path}: no such file or folder")
    if path.endswith(INDEX_SUFFIXES):
        return open_index(path)
    return open_single(path, f"weights {path}: unknown format; accepted: {ACCEPTED}")


def open_single(path: str, unknown: str) -> Mapping[str, torch.Tensor]:
    """One .safetensors or torch state-dict file; `unknown` is the error for any other name."""
    if path.endswith(".safetensors"):
        return load_safetensors(path)
    if path.endswith(TORCH_SUFFIXES):
        return load_torch(path)
    raise ValueError(unknown)


# ---- a folder ----
def pick_in_folder(folder: str) -> str:
    """The one weights file a folder means. Safetensors first (a Hugging Face repository often
    ships the same weights in both formats; transformers prefers safetensors too, and it unpickles
    nothing): its index, or else its one .safetensors file; then the same for torch files. Two
    candidates of the chosen format are ambiguous and refused, naming them."""
    names = sorted(os.listdir(folder))
    for index_suffix, file_suffixes in ((".safetensors.index.json", (".safetensors",)),
                                        (".bin.index.json", TORCH_SUFFIXES)):
        indexes = [n for n in names if n.endswith(index_suffix)]
        files = [n for n in names if n.endswith(file_suffixes)]
        if indexes or files:
            return os.path.join(folder, _one_candidate(folder, indexes, files))
    raise FileNotFoundError(f"weights folder {folder} holds no weights; accepted: {ACCEPTED}")


def _one_candidate(folder: str, indexes: list[str], files: list[str]) -> str:
    """The only index (every file beside it one of its shards), or else the only file."""
    if len(indexes) == 1:
        shards = set(read_weight_map(os.path.join(folder, indexes[0])).values())
        extra = [f for f in files if f not in shards]
        candidates = indexes + extra
    else:
        candidates = indexes or files
    if len(candidates) > 1:
        raise ValueError(f"weights folder {folder} is ambiguous: it holds {', '.join(candidates)}; pass the file itself")
    return candidates[0]


# ---- an index of shards ----
def read_weight_map(path: str) -> dict[str, str]:
    """An index's weight_map: tensor name -> shard file name (relative to the index's folder)."""
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"weights index {path} is not JSON ({e})") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise ValueError(f"weights index {path} has no weight_map (an object mapping each tensor name to its shard file)")
    return wm


def open_index(path: str) -> ShardedWeights:
    """Checks the whole index up front (every shard exists and holds the names mapped to it:
    a safetensors shard's header only, a torch shard's pickle), so a bad index fails at
    initialize rather than hours into materializing; maps no shard's data."""
    wm = read_weight_map(path)
    folder = os.path.dirname(os.path.abspath(path))
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        _check_shard(path, shard, os.path.join(folder, shard), names)
    return ShardedWeights(path, {name: os.path.join(folder, shard) for name, shard in wm.items()})


def _check_shard(index: str, shard: str, path: str, names: list[str]) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights index {index} names shard {shard}, which does not exist ({path})")
    if path.endswith(".safetensors"):
        have = load_safetensors(path)  # its header only
    elif path.endswith(TORCH_SUFFIXES):
        have = load_torch(path).keys()
    else:
        raise ValueError(f"weights index {index}: shard {shard} is neither .safetensors nor a torch state dict "
                         f"({', '.join(TORCH_SUFFIXES)})")
    missing = [n for n in names if n not in have]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"weights index {index} maps '{missing[0]}'{more} to shard {shard}, which has no such tensor")


class ShardedWeights(Mapping[str, torch.Tensor]):
    """name -> tensor over an index's shards, each mapped only while recently used."""

    def __init__(self, index: str, where: dict[str, str]) -> None:
        self.index, self.where = index, where  # where: tensor name -> its shard's path
        self._mapped: OrderedDict[str, Mapping[str, torch.Tensor]] = OrderedDict()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._shard(self.where[name])[name]

    def __contains__(self, name: object) -> bool:
        return name in self.where  # Mapping's default would map the shard to find out

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def mapped_shards(self) -> list[str]:
        """The shards mapped now, least recently used first (for tests and diagnostics)."""
        return list(self._mapped)

    def _shard(self, path: str) -> Mapping[str, torch.Tensor]:
        if path in self._mapped:
            self._mapped.move_to_end(path)
        else:
            self._mapped[path] = open_single(path, f"weights index {self.index}: shard {path} has an unknown format")
            while len(self._mapped) > OPEN_SHARDS:
                self._mapped.popitem(last=False)  # its tensors still out keep their mapping alive
        return self._mapped[path]


# ---- one file ----
def load_torch(path: str) -> Mapping[str, torch.Tensor]:
    """A torch state dict, memory-mapped; weights_only: nothing but tensors is unpickled."""
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"weights file {path}: {refused_pickle(exc)}") from None
    if not isinstance(sd, Mapping):
        raise ValueError(f"weights file {path} holds a {type(sd).__name__}, expected a state dict")
    return sd


def refused_pickle(exc: pickle.UnpicklingError) -> str:
    """One line of ours for what torch's weights-only unpickler refused, without torch's text
    (whose first line advises weights_only=False: running the file's code). Its reason names
    the global the file asks for (a class, a function such as os.system)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    reasons = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))]
    what = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if what is None and "Unsupported" not in str(exc):  # not a refusal: a damaged pickle
        return f"not a readable torch file ({(reasons or ['damaged pickle'])[0][:200]})"
    return (f"refused: this file needs arbitrary code to load; it names "
            f"{what.group(1) if what else 'an object a weights-only load does not allow'}, which only an "
            "unrestricted unpickler would run: use a file of plain tensors (a state_dict, or .safetensors)")


def _safe_open() -> Callable[..., Any]:
    """safetensors' reader, imported only when a .safetensors file is used (an optional dependency)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError("reading .safetensors weights needs the safetensors package: pip install safetensors "
                          "(or pip install zero_offload[hf])") from None
    return safe_open


class SafetensorsFile(Mapping[str, torch.Tensor]):
    """name -> tensor of one .safetensors file through safetensors' own reader: opening reads
    only the header; each tensor is read (from the file's mapping) when asked for, in any dtype
    the package and torch both have (bf16, fp16, fp8, unsigned and signed integers, bool, ...)."""

    def __init__(self, path: str) -> None:
        self.path = path
        safe_open = _safe_open()
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
            self._names = list(self._file.keys())
        except Exception as exc:
            raise ValueError(f"weights file {path} is not a readable safetensors file ({one_line(exc)})") from None
        self._known = set(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        try:
            return self._file.get_tensor(name)
        except Exception as exc:
            raise ValueError(f"weights file {self.path}: cannot read '{name}' ({one_line(exc)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_safetensors(path: str) -> SafetensorsFile:
    """The tensors of a .safetensors file, read lazily (see SafetensorsFile)."""
    return SafetensorsFile(path)


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    """Write a .safetensors file through the safetensors package (the tests write their weight
    files with it); each tensor is copied first, so tied tensors may be given as they are."""
    _safe_open()  # the same one-line error when the package is missing
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, path)
