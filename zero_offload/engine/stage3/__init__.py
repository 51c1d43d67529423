"""Stage 3: parameters sharded too, gathered unit by unit around each module's forward and backward.

`unit.Unit` is one unit and its state machine (its flat groups, gathered and released);
`policy` chooses which modules are units; `prefetch` gathers ahead of the schedule; `hooks`
installs the module and autograd hooks; `gathered` lends the full parameters to user code;
`runtime.Stage3Runtime` is the stage-3 runtime behind the facade. May import `engine.step`,
`engine.model`, the seam `engine.runtime` and layers below the engine; never `engine.buckets` or the facade.
"""
