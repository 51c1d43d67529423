"""Checkpoints: atomic, every tier's state, resharded on load, never unpickling objects.

Layout of a checkpoint directory:
  manifest.json          world size, stage, precision, step counters, hyperparameters, loss
                         scaler, parameter shapes, for every tensor file its tensors' shape, dtype
                         and CRC32, and (format 2) every tensor file's whole-file checksum and size
  rank{r}.json           rank r's shard map: for each shard key, which element ranges of which
                         parameters it holds (this is what lets a different D or bucketing load it),
                         and "lagging": the element ranges of its shards whose step count is below
                         their sub-shard's (parameters that had no gradient in some steps), by
                         parameter, with their own counts (absent in checkpoints saved before
                         per-parameter counts: every element then takes its shard's count, as the
                         engine that saved them had stepped every parameter)
  rank{r}.{key}.pt       master, m, v of one shard (one file per shard, so saving an NVMe-tier
                         state needs one shard in RAM at a time; read through the store); for a
                         frozen group inside a stage-3 unit, its compute-copy shard ("value"),
                         listed in rank{r}.json's frozen_map and resharded the same way
  rank{r}.rng.pt         that rank's RNG states (restored only when the world size is unchanged)
  rank{r}.buffers.pt     with D > 1, that rank's module buffers: ranks update them from their own
                         micro-batches (BatchNorm statistics), so they differ; restored over
                         model.pt's (rank 0's) only when the world size is unchanged
  model.pt               buffers and frozen parameters that live in the module itself
  manifest.crc32         the manifest's own CRC32 (manifest_checks.py)
  client_state.pt        what the caller passed as save_checkpoint's client_state (rank 0's: an
                         LR scheduler's state_dict, a data loader's position), if anything; its
                         size and CRC32 are in the manifest
All .pt files except client_state.pt hold plain tensors only and are read with torch.load(weights_only=True); the
manifest also holds the CRC32 of every rank{r}.json, and each rank{r}.json the whole-file checksums
of that rank's shard files ("checksums"), which the manifest gathers.

Saving happens only at a gradient-accumulation boundary (partial gradient sums are not part of a
checkpoint), so a load starts a fresh cycle and may change gradient_accumulation_steps.

Loading verifies the whole checkpoint before it changes anything: the manifest (its checksum,
every field's kind, one step count for every shard) and shard maps, the shapes of trainable and
frozen parameters, model.pt's names, shapes and dtypes, that the saved pieces cover every element,
and every file (its size and whole-file checksum, or for format 1 each tensor's CRC32, and its
tensors' shapes and dtypes): each rank the files it will read, its own rank{r}.* files and a share
of the rest, and all refuse if one does, leaving every engine as it was. Nothing is staged: the
apply pass reads each shard file again (checked again). What can only be found while the state is
being written (a file changed since it was verified, an I/O error of the engine's own store)
leaves every rank's engine refusing to train or save until a load succeeds (its state is partly
overwritten), rather than going on with a mixture.

Atomicity: everything is written into `<path>.tmp`, each file fsynced; rank 0 then moves an old
`<path>` aside to `<path>.old`, renames the new one into place, fsyncs the parent and deletes the
old one. A crash at any point leaves either `<path>` or `<path>.old` complete, and a load takes
`<path>.old` when `<path>` is missing. A save refuses a `<path>`, `<path>.tmp` or `<path>.old` that
holds anything but a checkpoint or a save's leftovers (each save marks its directory first), and a
path that is or holds the current directory. Multi-node saving needs `path` on a file system shared by
every rank: rank 0's marker holds a token every rank checks before writing, and a load checks that
every rank read the same manifest.

Where it lives: files.py writes every file durably (the one writer: write, fsync, close; the
directory swap) and verifies every checksum (the one verifier, for every kind of file); save.py
writes a checkpoint, load.py reads and applies one (reader.py its tensor files, plan.py what
fills each shard), common.py holds what both use; manifest_checks.py checks the manifest's
fields. This module is the names the facade and the tests import.
"""
from __future__ import annotations

import torch  # noqa: F401  (tests reach torch.save through this module)

from zero_offload.engine.state.files import CLIENT_FILE, FORMAT, MARKER, READABLE, CheckpointError
from zero_offload.engine.state.files import tensor_crc as _crc
from zero_offload.engine.state.load import apply_load, prepare_load
from zero_offload.engine.state.save import PAUSE_ENV, save

__all__ = ["CLIENT_FILE", "FORMAT", "MARKER", "PAUSE_ENV", "READABLE", "CheckpointError", "apply_load",
           "prepare_load", "save", "_crc"]
