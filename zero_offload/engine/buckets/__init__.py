"""Stages 0-2: every rank keeps the full compute copy; gradients are reduced in buckets.

`runtime.BucketRuntime` is the stage 0-2 runtime behind the facade; `grads` turns gradients into
grad shards (bucket layout, hooks, all-reduce or reduce-scatter in bucket order). May import
`engine.step`, `engine.model`, the seam `engine.runtime` and layers below the engine; never `engine.stage3` or the facade.
"""
