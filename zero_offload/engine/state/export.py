"""Streaming the model's weights out of the tiers, one flat buffer at a time (issue 21).

consolidated_state_dict builds the whole state dict first: at stage 3 with parameters on nvme
that is the whole model in RAM, which the engine exists to avoid. Here the state dict's values
come out in the order they are gathered: one flat buffer (a stage-3 unit's trainable or frozen
group, a stage 0-2 bucket) is read from its tier and, at D > 1, all-gathered; its parameters'
values are handed on and it is dropped before the next is read. Tensors the module holds whole
anyway (buffers, stage 0-2 frozen parameters) come last. Only the flat buffers holding a wanted
key are read (the adapters of a frozen base: the base is never touched).

The values are what consolidated_state_dict gives, in the model's own dtypes (ModelView.orig_dtypes):
trainable parameters from the fp32 master shard, frozen ones from the compute copy, buffers as
they are.

`save_safetensors` writes them in Hugging Face's layout: model.safetensors, or shards
model-0000k-of-0000n.safetensors of at most max_shard_size bytes (split as huggingface_hub
splits a state dict, in streamed order) with model.safetensors.index.json. A safetensors file is
an 8-byte header length, a JSON header giving each tensor's dtype, shape and byte range, then the
bytes. Every shape and dtype is known before anything is read, so each file's header is written
first and each tensor's bytes are appended as the tensor arrives: a file is never held whole in
memory (transformers' default 50 GB shard would otherwise be the whole model), only one flat
buffer is. Files are written aside (`.partial`) and renamed into place once all are complete.

Both are collectives: every rank gathers every flat buffer holding a wanted key, in the same
order; the ranks told to write do. A rank whose read or write fails goes on gathering (writing
nothing more), and every rank raises at the end, so none is left waiting in a gather.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import torch
from torch import nn

from zero_offload import comm
from zero_offload.engine.runtime import FlatSource, ModelView, Runtime
from zero_offload.engine.state.files import durable, fsync_path

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 50 * 10 ** 9  # transformers' save_pretrained default ("50GB")
PARTIAL = ".partial"  # a file being written, renamed into place once the whole save is written
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
                torch.complex64: "C64"}


class ExportError(RuntimeError):
    """Another rank's read or write failed during a streamed save; this rank raises too."""


@dataclass(frozen=True)
class Spec:
    """A state-dict tensor as it is saved: its shape and the model's own dtype."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()


def tensor_specs(rt: Runtime, model: ModelView) -> dict[str, Spec]:
    """Each state-dict tensor's shape and saved dtype, in state-dict order, without reading any
    value (at stage 3 the parameters are empty between passes: shapes come from the layouts)."""
    shapes = {id(p): s for g in rt.flat_sources() for p, s in zip(g.params, g.layout.shapes)}
    return {k: Spec(torch.Size(shapes.get(id(v), v.shape)), model.orig_dtypes.get(k, v.dtype))
            for k, v in model.module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


# ---- the stream ------------------------------------------------------------------------------

@dataclass
class _Plan:
    """What to gather, in order: flat buffers with the wanted keys of their parameters (index in
    the buffer, key), then the keys of tensors the module holds whole."""

    groups: list[tuple[FlatSource, list[tuple[int, str]]]]
    module_keys: list[str]
    order: list[str]  # every key, in the order the stream yields them


def _plan(rt: Runtime, model: ModelView, keys: Sequence[str]) -> _Plan:
    state = model.module.state_dict(keep_vars=True)
    unknown = [k for k in keys if not isinstance(state.get(k), torch.Tensor)]
    if unknown:
        raise KeyError(f"not tensors of the model's state_dict: {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
    wanted: dict[int, list[str]] = {}
    for k in keys:
        wanted.setdefault(id(state[k]), []).append(k)
    groups, streamed = [], set()
    for g in rt.flat_sources():
        items = [(i, k) for i, p in enumerate(g.params) for k in wanted.get(id(p), ())]
        if items:
            groups.append((g, items))
            streamed.update(k for _, k in items)
    rest = [k for k in keys if k not in streamed]
    return _Plan(groups, rest, [k for _, items in groups for _, k in items] + rest)


def _gathered(device: torch.device, g: FlatSource, failures: list[BaseException]) -> torch.Tensor:
    """The whole flat buffer on the CPU. A failed read at D > 1 is noted and zeros are sent in its
    place, so the other ranks are not left waiting in the all-gather."""
    try:
        shard = g.read()
    except Exception as exc:
        if comm.world_size() == 1:
            raise
        failures.append(exc)
        shard = torch.zeros(g.layout.shard_numel, dtype=g.dtype)
    if g.layout.world == 1:  # D = 1, or a stage-0 replica: this rank holds it all
        return shard
    full = torch.empty(g.layout.padded_numel, dtype=shard.dtype, device=device)
    comm.all_gather_(full, shard.to(device))  # on the device: NCCL needs it there
    return full.cpu()


def _values(model: ModelView, plan: _Plan, failures: list[BaseException]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, CPU value in the model's dtype), in plan.order; one flat buffer alive at a time."""
    dtypes = model.orig_dtypes
    for g, items in plan.groups:
        views = g.layout.views(_gathered(model.device, g, failures))
        for i, key in items:
            yield key, views[i].to(dtypes.get(key, views[i].dtype))
        del views
    state = model.module.state_dict(keep_vars=True)
    for key in plan.module_keys:
        value = state[key]
        yield key, value.detach().to("cpu", dtypes.get(key, value.dtype))


def _raise_agreed(error: BaseException | None) -> None:
    """Every rank raises when any rank failed (this rank's own error where it had one)."""
    if comm.world_size() == 1:
        if error is not None:
            raise error
        return
    agreed = comm.first_failure(error)
    if agreed is None:
        return
    if error is not None:
        raise error
    rank, message = agreed
    raise ExportError(f"the streamed save failed on rank {rank}: {message}")


def _attempt(fn: Callable[..., None], *args: Any) -> BaseException | None:
    """fn(*args); its failure is raised at D = 1 and returned at D > 1, where the ranks agree on
    it later (raising now would leave the others waiting in the next gather)."""
    try:
        fn(*args)
    except Exception as exc:
        if comm.world_size() == 1:
            raise
        return exc
    return None


def _run(model: ModelView, plan: _Plan, take: Callable[[str, torch.Tensor], None],
         begin: Callable[[], None] | None = None, end: Callable[[], None] | None = None) -> None:
    """Stream the plan's keys into `take` on every rank, between `begin` and `end`. Failures are
    agreed after `begin` (a writer that cannot start stops every rank before any gather) and at
    the end; a rank that failed goes on gathering and takes nothing more."""
    if comm.world_size() > 1 and not comm.all_agree(hashlib.sha1("\n".join(plan.order).encode()).hexdigest()):
        raise ExportError("the ranks asked a streamed save for different keys; every rank must pass the same ones")
    error = _attempt(begin) if begin is not None else None
    _raise_agreed(error)
    failures: list[BaseException] = []  # reads that failed (zeros were sent in their place)
    for key, value in _values(model, plan, failures):
        if error is None:
            error = _attempt(take, key, value)
        del value  # a view: held into the next read, it would keep its whole flat buffer alive
    if error is None and end is not None:
        error = _attempt(end)
    _raise_agreed(error if error is not None else (failures[0] if failures else None))


def state_dict(rt: Runtime, model: ModelView, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The values of `keys` on every rank (a collective), each its own tensor: a view would keep
    its whole flat buffer alive."""
    out: dict[str, torch.Tensor] = {}

    def take(key: str, value: torch.Tensor) -> None:
        out[key] = value.clone() if value.untyped_storage().nbytes() > value.nbytes else value

    _run(model, _plan(rt, model, list(dict.fromkeys(keys))), take)
    return out


# ---- safetensors files ---------------------------------------------------------------------------

def split_files(entries: Sequence[tuple[str, Spec]], max_shard_size: int) -> list[list[str]]:
    """The keys of each output file, in streamed order, as huggingface_hub splits a state dict: a
    new file when the next tensor would take this one past max_shard_size, a tensor larger than
    that alone in a file of its own (here the file being filled ends first, so files are written
    one after another)."""
    files: list[list[str]] = []
    current: list[str] = []
    size = 0
    for key, spec in entries:
        n = spec.nbytes
        if current and (n > max_shard_size or size + n > max_shard_size):
            files.append(current)
            current, size = [], 0
        current.append(key)
        size += n
        if n > max_shard_size:
            files.append(current)
            current, size = [], 0
    if current or not files:
        files.append(current)
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def header(entries: Sequence[tuple[str, Spec]], metadata: dict[str, str]) -> bytes:
    """A safetensors header: the length (u64, little-endian), then the JSON, padded with spaces to
    a multiple of 8 bytes so the data that follows is aligned; the tensors lie back to back in
    `entries` order."""
    described: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, spec in entries:
        if spec.dtype not in _DTYPE_NAMES:
            raise TypeError(f"safetensors has no dtype for {key!r} ({spec.dtype}); cast it before saving")
        described[key] = {"dtype": _DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                          "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(described, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter:
    """Writes planned files in order: a file's header when its first tensor comes (or at the end,
    for an empty file), then each tensor's bytes as it comes, checked against the plan.

    Each file is written as `<name>.partial` and fsynced; only once every file is complete are
    they renamed over an earlier save's (and its files this one does not replace removed), so a
    save that fails or is cut off part way leaves the earlier save as it was, not truncated."""

    def __init__(self, directory: str, files: list[tuple[str, list[tuple[str, Spec]]]],
                 metadata: dict[str, str]) -> None:
        self.directory, self.files, self.metadata = directory, files, metadata
        self._next = [(i, key, spec) for i, (_, entries) in enumerate(files) for key, spec in entries]
        self._pos = 0
        self._file: BinaryIO | None = None
        self._opened = -1  # index of the last file opened
        self._written: list[str] = []  # names whose .partial file is complete

    def partial(self, name: str) -> str:
        return os.path.join(self.directory, name + PARTIAL)

    def begin(self) -> None:
        os.makedirs(self.directory, exist_ok=True)

    def _open(self, index: int) -> None:
        while self._opened < index:
            self._close_file()
            self._opened += 1
            name, entries = self.files[self._opened]
            self._file = open(self.partial(name), "wb")
            self._file.write(header(entries, self.metadata))

    def take(self, key: str, value: torch.Tensor) -> None:
        if self._pos >= len(self._next) or self._next[self._pos][1] != key:
            raise RuntimeError(f"streamed save: {key!r} arrived out of the planned order")
        index, _, spec = self._next[self._pos]
        if tuple(value.shape) != tuple(spec.shape) or value.dtype != spec.dtype:
            raise RuntimeError(f"streamed save: {key!r} is {tuple(value.shape)} {value.dtype}, the header says "
                               f"{tuple(spec.shape)} {spec.dtype}")
        self._open(index)
        if value.numel():
            self._file.write(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._pos += 1

    def finish(self) -> None:
        if self._pos != len(self._next):
            raise RuntimeError(f"streamed save: {len(self._next) - self._pos} planned tensors never arrived")
        self._open(len(self.files) - 1)  # files left with no tensor at all
        self._close_file()

    def add_written(self, name: str) -> None:
        """A file written by the caller as `partial(name)` (the index) to publish with the rest."""
        self._written.append(name)

    def publish(self) -> None:
        """Every complete file renamed into place, then the earlier save's files this one does not
        replace removed (an old single file would shadow new shards, old shards would be left
        over), the folder fsynced."""
        for name in self._written:
            os.replace(self.partial(name), os.path.join(self.directory, name))
        names, sharded = set(self._written), len(self.files) > 1
        for name in os.listdir(self.directory):
            stale = (_SHARD_NAME.fullmatch(name) and name not in names) or (name == WEIGHTS_NAME and sharded) \
                or (name == INDEX_NAME and not sharded)
            if stale and os.path.isfile(os.path.join(self.directory, name)):
                os.remove(os.path.join(self.directory, name))
        self._written = []
        fsync_path(self.directory)

    def _close_file(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.flush()
                os.fsync(f.fileno())
            finally:
                f.close()
            self._written.append(self.files[self._opened][0])

    def abandon(self) -> None:
        """After a failure: the open file closed and every .partial file of this save removed."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for name, _ in self.files:
            if os.path.exists(self.partial(name)):
                os.remove(self.partial(name))
        if os.path.exists(self.partial(INDEX_NAME)):
            os.remove(self.partial(INDEX_NAME))


def save_safetensors(rt: Runtime, model: ModelView, directory: str, keys: Sequence[str] | None = None, *,
                     max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, write: bool | None = None,
                     index_metadata: dict[str, Any] | None = None) -> dict[str, str]:
    """Write `keys` (default: every state-dict tensor) to `directory` in Hugging Face's layout;
    returns the weight map (key -> file) on every rank. `write` defaults to rank 0."""
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size < 1:
        raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    specs = tensor_specs(rt, model)
    keys = list(dict.fromkeys(specs if keys is None else keys))
    plan = _plan(rt, model, keys)
    entries = [(k, specs[k]) for k in plan.order]
    parts = split_files(entries, max_shard_size)
    files = [(name, [(k, specs[k]) for k in part]) for name, part in zip(file_names(len(parts)), parts)]
    weight_map = {k: name for name, part in files for k, _ in part}
    write = comm.rank() == 0 if write is None else write
    writer = SafetensorsWriter(directory, files, {"format": "pt"})

    def end() -> None:
        writer.finish()
        if len(files) > 1:
            _write_index(writer.partial(INDEX_NAME), entries, weight_map, model.module, index_metadata)
            writer.add_written(INDEX_NAME)
        writer.publish()

    try:
        if write:
            _run(model, plan, writer.take, writer.begin, end)
        else:
            _run(model, plan, lambda key, value: None)
    finally:
        writer.abandon()
    return weight_map


def _write_index(path: str, entries: list[tuple[str, Spec]], weight_map: dict[str, str], module: nn.Module,
                 extra: dict[str, Any] | None) -> None:
    """model.safetensors.index.json as transformers writes it (sorted keys, two-space indent)."""
    params = {n for n, _ in module.named_parameters()}
    metadata = {"total_size": sum(s.nbytes for _, s in entries),
                "total_parameters": sum(s.shape.numel() for k, s in entries if k in params), **(extra or {})}
    with durable(path, "w") as f:
        f.write(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
