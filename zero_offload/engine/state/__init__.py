"""Training state on disk: checkpoints, their checks, and the model streamed out for Hugging Face.

`checkpoint` saves and loads everything a run needs to resume bit for bit (shards, frozen
parameters, buffers, RNG, step counts) transactionally; `manifest_checks` verifies a checkpoint
before anything changes; `export` streams the full model out as safetensors. May import
`engine.step`, `engine.model`, the seam `engine.runtime` and layers below the engine; reaches a
runtime only through `engine.runtime.Runtime`, which the facade hands it.
"""
