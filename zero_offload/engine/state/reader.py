"""Reading a checkpoint's tensor files, each checked against the manifest whenever it is read."""
from __future__ import annotations

import os
from typing import Any

import torch

from zero_offload.engine.state import files
from zero_offload.engine.state.files import CheckpointError, Kind


class Reader:
    """Reads the tensor files of one checkpoint, each checked against the manifest whenever it is
    read: its size, its whole-file checksum where the manifest holds one of this process's kind
    (else, as format 1, every tensor's CRC32), and every tensor's shape and dtype. The verify
    pass reads a file and keeps nothing; the apply pass reads it again, checked again (a file
    that changed in between fails then)."""

    def __init__(self, root: str, manifest: dict[str, Any]) -> None:
        self.root, self.files = root, manifest["files"]
        self._cache: dict[str, dict[str, torch.Tensor]] = {}
        self.sizes: dict[str, int] = manifest.get("sizes", {})
        self.sums: dict[str, int] = files.whole_file_sums(manifest.get("checksums", {}))

    def verify(self, name: str) -> None:
        self._read(name)

    def get(self, name: str) -> dict[str, torch.Tensor]:
        if name not in self._cache:
            self._cache = {}  # one shard file mapped at a time
            self._cache[name] = self._read(name)
        return self._cache[name]

    def _read(self, name: str) -> dict[str, torch.Tensor]:
        full = os.path.join(self.root, name)
        if name not in self.files:
            raise CheckpointError(f"checkpoint file {full} is not in the manifest")
        files.verify(full, Kind.TENSORS, self.sizes.get(name), self.sums.get(name))
        data = files.load_tensors(full)
        for k, meta in self.files[name].items():
            t = data.get(k) if isinstance(data, dict) else None
            seen = None if not isinstance(t, torch.Tensor) else files.describe(t) if name not in self.sums \
                else files.kind_of(t)
            if seen is None or any(seen[f] != meta.get(f) for f in seen):
                raise CheckpointError(f"checkpoint file {full}: tensor {k!r} is missing, or its shape, dtype or "
                                      "checksum differs from the manifest")
        return data
