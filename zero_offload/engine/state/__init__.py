"""Training state on disk: checkpoints, their checks, and the model streamed out for Hugging Face.

`checkpoint` is the names the facade imports (save, prepare_load, apply_load, CheckpointError)
and documents the checkpoint layout; `save` and `load` do the work, `reader` reads tensor files
and `plan` works out what fills each shard, `common` holds what both use. `files` is the one
durable writer and the one checksum verifier every file goes through; `manifest_checks` verifies
the manifest's fields before anything changes; `export` streams the full model out as
safetensors. May import `engine.step`, `engine.model`, the seam `engine.runtime` and layers below
the engine; reaches a runtime only through `engine.runtime.Runtime`, which the facade hands it.
"""
