"""engine/state/files.py is the one durable writer and the one checksum verifier of a checkpoint
(issue 23): every file a save leaves is written through `files.durable` (fsynced before the swap),
and every kind of file is verified by `files.verify` with the checksum `files.checksum_of` records."""
from __future__ import annotations

import contextlib
import os
import zlib
from typing import Any, Iterator

import pytest

from test_checkpoint_checks import _engine, _train
from zero_offload.engine.state import files, manifest_checks
from zero_offload.engine.state.checkpoint import CheckpointError
from zero_offload.engine.state.files import Kind
from zero_offload.io import checksum


def test_every_file_of_a_checkpoint_is_written_by_the_one_durable_writer(tmp_path: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file in the saved directory was opened by files.durable and fsynced there (the marker
    is the one exception: a save's own leftover sign, removed with the directory or kept in it)."""
    fsynced: set[str] = set()
    real_durable = files.durable

    @contextlib.contextmanager
    def durable(path: str, mode: str = "wb") -> Iterator[Any]:
        with real_durable(path, mode) as f:
            yield f
        fsynced.add(os.path.basename(path))
    monkeypatch.setattr(files, "durable", durable)
    engine = _engine()
    _train(engine, range(1))
    ck = str(tmp_path / "ck")
    engine.save_checkpoint(ck, client_state={"epoch": 3})
    engine.close()
    saved = set(os.listdir(ck)) - {files.MARKER}
    assert saved == fsynced and {"manifest.json", manifest_checks.CRC_FILE, "model.pt", files.CLIENT_FILE} <= saved


def test_one_verifier_for_every_kind_of_file(tmp_path: Any) -> None:
    """The checksum each kind records is the one the verifier checks; a changed byte fails each
    kind with its own message."""
    path = str(tmp_path / "f")
    data = os.urandom(3 * checksum.FILE_CHUNK // 2)
    with files.durable(path) as f:
        f.write(data)
    assert files.checksum_of(Kind.TENSORS, path) == files.checksum_of(Kind.TENSORS, data=data) \
        == checksum.file_checksum(path)
    assert files.checksum_of(Kind.JSON, path) == files.checksum_of(Kind.CLIENT, data=data) == zlib.crc32(data)
    told = {Kind.TENSORS: "fails its checksum \\(damaged or replaced\\)", Kind.JSON: "fails its checksum$",
            Kind.CLIENT: "its size or checksum differs from the manifest"}
    for kind, message in told.items():
        recorded = files.checksum_of(kind, path)
        files.verify(path, kind, len(data), recorded)
        assert files.read_verified(path, kind, len(data), recorded) == data
        with pytest.raises(CheckpointError, match=message):
            files.verify(path, kind, len(data), recorded ^ 1)
    with pytest.raises(CheckpointError, match=r"has \d+ bytes, the manifest says 1 \(truncated or replaced\)"):
        files.verify(path, Kind.TENSORS, 1)
    with pytest.raises(CheckpointError, match="cannot read checkpoint file .*missing: FileNotFoundError"):
        files.read_verified(str(tmp_path / "missing"), Kind.JSON)
