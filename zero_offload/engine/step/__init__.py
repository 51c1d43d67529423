"""The step pipeline: where a shard lives and how it is stepped.

Owns the optimizer state of every shard (`shard_optimizer.ShardOptimizer`: master shard and
moments in a store of the optimizer tier), the overlapped step that updates it
(`pipeline.StepPipeline`: the entry is `ShardOptimizer.grad_ready` during backward and
`ShardOptimizer.finish_step` at the boundary), the staging ring that streams non-resident state
through pinned memory, sub-shards, precision (loss scale, clipping), parameter groups and the
gradient-accumulation buffers. Imports only layers below the engine; nothing else of the engine.
"""
