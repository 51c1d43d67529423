"""The engine: the facade (`engine.Engine`) over one runtime per ZeRO family.

Sub-packages, bottom up: `step` (shards, their optimizer state and the overlapped step),
`model` (building and binding the user's module), `buckets` (stages 0-2) and `stage3` (units),
`state` (checkpoints and the weights export). The facade files here (`engine.py`, `memory.py`,
`preemption.py`) may import all of them; none of them imports the facade. The seam `runtime.py`
(the `Runtime` protocol and the records crossing it) imports only `step` and below, and every
layer above it may import it.
tests/test_import_contract.py checks the order.
"""
