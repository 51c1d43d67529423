"""ZeRO stage 3 (ZeRO-Infinity): parameters partitioned, gathered unit by unit, on any tier.

Stage3Runtime provides the runtime interface the Engine drives (engine/runtime.py's `Runtime`,
as BucketRuntime does), plus consolidated_state_dict() (collective; full fp32 weights by name on
every rank), stats() (live budget, peak gathered bytes, fetch counts), `units`, and for
gathered.py begin_gathered() / end_gathered().
The Engine calls the model itself; forward hooks do the rest. A pass starts at the model's
forward pre-hook and ends at end_backward (or at the next forward, for a forward-only pass).

One pass: forward acquires each unit around its root's forward (prefetch.Prefetcher fetches and
all-gathers it), backward gathers it again when the gradient of its outputs arrives, and when its
trainable parameters have all accumulated their gradients it reduce-scatters them (scaled by
1/(D x accumulation steps)), hands this rank's grad shard to the ShardOptimizer and releases the
unit. end_backward reduces, in unit order, every unit that did not finish (parameters that got no
gradient count as zero), then the ranks agree on which parameters no rank had a gradient for
(Accumulator.agree) and those units go to the step with them left out: as torch's optimizers
skip a .grad of None, they are not stepped. step() runs the optimizer; its on_updated callback
writes each new compute-copy shard to the params tier, then the prefetcher starts fetching the next pass's first
units. Units smaller than stage3.resident_bytes stay gathered on the device for the whole run
(outside the live budget); after each step they take their new shard in place and all-gather.

Pass state. The Engine's phase (engine/phase.py) is read, never kept here (`phase`); the runtime
keeps the pass as its hooks see it (PassStage: CLOSED, FORWARD, BACKWARD from begin_backward to
end_backward) and one unit.UnitPass per unit (references held, backward progress), all made anew
by _reset_pass.

Reads elsewhere. A recording pass (the first, one that follows a pass that found such reads,
changed order or failed) runs its forward under hooks.ReadWatch: a torch call given a parameter
of a released unit (a head written `F.linear(x, self.wte.weight)` in the model's forward) gathers
that unit on demand for the innermost hooked call in progress, and records it against that
module (`units_of`), whose later calls acquire it at entry and whose backward gathers it, as
for a tied module found at initialize. Later passes run unwatched: the watch costs about as
much as the torch call it looks at.
"""
from __future__ import annotations

import enum
import time
import warnings
from collections import deque
from functools import partial
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from zero_offload import comm
from zero_offload.config import Config, ConfigError
from zero_offload.engine.stage3 import hooks
from zero_offload.engine.model import materialize
from zero_offload.engine.step.accumulate import Accumulator, missing_ranges
from zero_offload.engine.stage3.prefetch import BudgetExceeded, Prefetcher, check_same_unit
from zero_offload.engine.step.precision import refuse_unheld
from zero_offload.engine.step.shard_optimizer import DTYPES, ShardOptimizer
from zero_offload.engine.model.attributes import check_bindings, param_bindings
from zero_offload.engine.phase import Phase, PhaseMachine, PhaseView
from zero_offload.engine.runtime import (FROZEN_ROW, FlatSource, RuntimeBase, close_in_order, consolidate, padding,
                                          pieces_of)
from zero_offload.engine.stage3.unit import FlatGroup, GatherBuffers, PassStateError, Unit, UnitPass, UnitState
from zero_offload.engine.stage3.policy import Plan, RootCheck, kept_in_module, plan_units
from zero_offload.io.buffers import ALIGN_BYTES, aligned_tensor
from zero_offload.optim.registry import spec_for
from zero_offload.interrupts import held_interrupts
from zero_offload.store import make_store
from zero_offload.tiers import CPU, tier
from zero_offload.trace import tracer

BLOCK = ALIGN_BYTES  # an NVMe slot's rounding: each unit's capacity allows for it
WRITES_IN_FLIGHT = 4  # updated compute-copy shards written behind the step at once


# Autograd reports each parameter's gradient once per backward, after summing every use: a unit
# is reduced and released when all of its parameters have reported. A reentrant checkpoint runs
# its part of backward as a separate autograd pass, so a module used both inside and outside it
# (or inside two) reports twice, after its unit was reduced from a partial gradient.
_TWICE = ("stage 3: unit '{unit}' {what} after its gradients were reduced in this backward: its module "
          "runs backward in two separate autograd passes, as under torch.utils.checkpoint(..., "
          "use_reentrant=True) around a module that is also used outside that checkpoint or in another; "
          "use use_reentrant=False")

class PassStage(enum.Enum):
    """Where the current pass stands as stage 3's hooks see it: a sub-state of the engine's
    phase (phase.py), not a second phase. The hooks keep it because they also see the model
    called directly and a runtime driven without an Engine, and end_backward closes the pass
    while the engine stays in BACKWARD until step().
        CLOSED --model's pre-hook--> FORWARD --begin_backward--> BACKWARD --end/abort_backward--> CLOSED
    (FORWARD --pre-hook--> FORWARD: the next pass, after an evaluation or a failed forward; a
    forward hook in BACKWARD is a checkpoint's recomputation.)"""

    CLOSED = "closed"
    FORWARD = "forward"
    BACKWARD = "backward"


def _has_frozen(u: Unit) -> bool:
    return any(not g.trainable for g in u.groups)


def _kept_params(model: nn.Module, device: torch.device) -> list[nn.Parameter]:
    """The frozen parameters no unit holds (policy.kept_in_module: integer, bool, complex), moved
    whole to the compute device in their own dtype, as the buffers are; one on the meta device has
    no value to keep, and none of the sources that fill units (they fill floats) gives it one."""
    kept: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters():
        if kept_in_module(p):
            if p.is_meta:
                raise ConfigError(f"initialize: frozen {p.dtype} parameter '{name}' is on the meta device; stage 3 "
                                  "fills only floating-point parameters: build the module that registers it for real")
            p.data = p.data.to(device)
            kept[id(p)] = p
    return list(kept.values())


class Stage3Runtime(RuntimeBase):
    """Stage 3 behind the Engine's runtime interface; see the module docstring."""

    replicated = False

    def __init__(self, model: nn.Module, config: Config, device: torch.device, *,
                 init_fn: materialize.InitFn | None = None, weights: materialize.Weights = None,
                 phase: PhaseView | None = None) -> None:
        self.model, self.config, self.device = model, config, torch.device(device)
        self._engine_phase = phase or PhaseMachine().view()  # the Engine's; without one, always idle
        self.world, self.rank = comm.world_size(), comm.rank()
        self.dtype = DTYPES[config.precision.dtype]
        self.scale = 1.0 / (self.world * config.gradient_accumulation_steps)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.users: dict[nn.Module, tuple[Unit, ...]] = {}
        self.refuse_compiled(model)
        refuse_unheld(model, self.dtype)
        plan = plan_units(model, config.stage3, elem)
        self._kept = _kept_params(model, self.device)
        meta = any(p.is_meta for p in model.parameters())
        shapes = {id(p): p.shape for u in plan.units for _, p in u.params}
        if meta:
            new = materialize.replace_meta_params(model, self.dtype, self.device)
            for up in plan.units:
                up.params = [(n, new.get(id(p), p)) for n, p in up.params]
            shapes = {(id(new[k]) if k in new else k): s for k, s in shapes.items()}
        self._handles: list = []
        self._root_check: RootCheck | None = None
        self._routed = plan.routed
        self.prefetcher: Prefetcher | None = None
        self.shard_optimizer: ShardOptimizer | None = None
        self.accumulator: Accumulator | None = None
        self.params_store = None
        self.params_cpu_store = None
        try:
            self._make_units(plan, elem, shapes)
            self.bindings = param_bindings(model)  # after a meta model's parameters were replaced
            self._check_budget(plan)
            # Units gathered around other units (the root): see _held_to_end (every chain counts
            # them in the budget already).
            self._enclosing = {i for m, chain in plan.chains.items() for i in chain if i not in plan.users.get(m, ())}
            opt_numel = sum(g.layout.shard_numel for u in self.units for g in u.groups if g.trainable)
            # Updates stream to the params tier as each shard is stepped (under backward), so the
            # updated shards are never all held at once and the step does not wait for their writes.
            capacity = spec_for(config.optimizer.name).state_bytes(opt_numel) + len(self.units) * 4 * BLOCK + (1 << 20)
            self.shard_optimizer = ShardOptimizer(config, self.device, self._on_updated, stream_updates=True,
                                                  capacity_bytes=capacity)
            source, where = materialize.open_source(weights)  # a file, a folder, or a WeightSource
            filler = materialize.WeightFiller(model, meta=meta, init_fn=init_fn, weights=source, source=where,
                                              shapes=shapes)
            for u in self.units:
                self._materialize(u, filler)
            filler.finish(self.device, self.dtype)  # every buffer has its value (or initialize fails naming it)
            for b in [*model.buffers(), *self._kept]:
                comm.broadcast_(b.data, 0)
            del source
            self.prefetcher = Prefetcher(self.units, config.stage3.live_budget_bytes, config.stage3.prefetch_depth,
                                         plan.siblings)
            self._gather_resident()
            self.users = {m: tuple(self.units[i] for i in ix) for m, ix in plan.users.items()}
            self.users.setdefault(model, ())  # the model's own hooks start each pass, even with no unit of its own
            self._init_read_watch(model)
            self._handles = hooks.install_module_hooks(self.users, self) + hooks.install_param_hooks(self.units, self)
            self._handles += [m.register_state_dict_pre_hook(self._guard_state_dict) for m in self.users]
            self._adopted: list[str] = []  # modules that acquire a unit whose root's forward did not run (adopt)
            self._root_check = RootCheck(model, plan, lambda i: self.units[i].state is UnitState.GATHERED,
                                         named=bool(config.stage3.unit_modules),
                                         in_backward=lambda: self.stage is PassStage.BACKWARD, adopt=self.adopt)
            # After the model's post-hook, and also when its forward raises: the read watch ends there.
            self._handles.append(model.register_forward_hook(self._forward_done, always_call=True))
            self.accumulator = Accumulator.on_grads_tier(config, self.device, self.rank,
                                                         {g.key: len(g.params) for _, g in self._trainable()},
                                                         1 << 20)  # NVMe files grow on demand
            self.stage = PassStage.CLOSED
            self.boundary = True  # begin_backward's: whether this backward ends an accumulation cycle
            self.gathering = False  # inside engine.gathered (gathered.py)
            self._fresh: dict[str, torch.Tensor] = {}
            self._writing: deque[tuple[Unit, str]] = deque()  # updated shards being written (oldest first)
            self._waiting: list[tuple[Unit, torch.Tensor]] = []  # reduced, incomplete here: for the agreement
            self._watches: list[hooks.InputWatch] = []
            self._pinned: list[Unit] = []  # units used under torch.func transforms: gathered until backward ends
            self._reset_pass()
        except BaseException:  # an init_fn that raises, a full drive: what was made goes (threads, files, locks)
            self.close()
            raise

    @property
    def phase(self) -> Phase:
        """The Engine's phase (read-only: the Engine moves it); stage 3's finer view is `stage`."""
        return self._engine_phase.phase

    def _to_stage(self, allowed: tuple[PassStage, ...], to: PassStage) -> None:
        if self.stage not in allowed:
            raise PassStateError(f"stage 3: the pass moves to {to.value} from {self.stage.value} (internal error)")
        self.stage = to

    def units_in_use(self) -> bool:
        """Whether a call in progress (or a backward) holds a unit of the current pass."""
        return any(r.refs for r in self._unit_pass)

    def refuse_compiled(self, module: nn.Module) -> None:
        """torch.compile traces the engine's hooks (Dynamo fails on them) and saves parameters
        whose later re-gather in backward it takes for an in-place change: refused in one line,
        for the model and for each module that owns a unit (where `.compile()` would go; at
        initialize, before units exist, every module)."""
        for m in (module, *(self.users or module.modules())):
            if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
                raise RuntimeError("stage 3 does not run under torch.compile (the model or one of its units is "
                                   "compiled); compile at stages 0-2, or leave the model uncompiled")

    def _guard_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """`module.state_dict()` outside a pass or engine.gathered() would return the sharded
        parameters' empty tensors without a word; refused. With keep_vars=True the caller asks
        for the parameter objects themselves (the engine's own checkpoint code does), not values."""
        if keep_vars:
            return
        units = self.units if module is self.model else self.users.get(module, ())
        sharded = [u.name for u in units if u.state is not UnitState.GATHERED]  # a read ahead is not yet whole
        if sharded:
            raise RuntimeError(f"stage 3: {prefix.rstrip('.') or 'the model'}.state_dict() while units {sharded[:3]}"
                               f"{'...' if len(sharded) > 3 else ''} are sharded would hold empty parameters; use "
                               "engine.consolidated_state_dict(), or call it inside `with engine.gathered():`")

    def gathered(self, params: list[nn.Parameter], modify: bool) -> Any:
        """engine.gathered at stage 3 (gathered.py)."""
        from zero_offload.engine.stage3.gathered import gathered

        return gathered(self, params, modify)

    def begin_gathered(self) -> None:
        """engine.gathered's units are about to be gathered: refused while a forward's units are
        in use, or inside another engine.gathered (whose units its release_all would take)."""
        if self.units_in_use():
            raise RuntimeError("engine.gathered: a forward's units are still in use (call it after engine.step(), "
                               "or after an evaluation forward, not between a forward and its backward)")
        if self.gathering:
            raise RuntimeError("engine.gathered: already inside engine.gathered(); name every parameter or module "
                               "you need in one call")
        self.gathering = True

    def end_gathered(self) -> None:
        """engine.gathered's block is over (however it ended)."""
        self.gathering = False

    # ---- construction ----
    def _make_units(self, plan: Plan, elem: int, shapes: dict[int, torch.Size]) -> None:
        numels = [sum(shapes[id(p)].numel() for _, p in up.params) for up in plan.units]
        in_cpu = self._units_in_cpu(numels)
        rest = [n for i, n in enumerate(numels) if i not in in_cpu]
        self.params_store = make_store(self.config.tiers.params, "params", self.config, device=self.device,
                                       rank=self.rank, capacity_bytes=self._capacity(rest, elem))
        self.params_cpu_store = None if not in_cpu else make_store(  # stage3.max_in_cpu's units
            CPU.name, "params", self.config, device=self.device, rank=self.rank,
            capacity_bytes=self._capacity([numels[i] for i in in_cpu], elem))
        self.gather_buffers = GatherBuffers(self.params_store)
        self.units: list[Unit] = []
        for i, up in enumerate(plan.units):
            named = [(n, p, shapes[id(p)]) for n, p in up.params]
            store = self.params_cpu_store if i in in_cpu else self.params_store
            self.units.append(Unit(i, up.name or "<root>", named, dtype=self.dtype, device=self.device,
                                   store=store, staging=self.gather_buffers))
        for u in self.units:
            u.resident = u.nbytes < self.config.stage3.resident_bytes
        self.by_key = {g.key: (u, g) for u in self.units for g in u.groups}

    def _capacity(self, numels: list[int], elem: int) -> int:
        """A params store's bytes for units of these sizes: this rank's shards, their padding and slot rounding."""
        return (sum(numels) // self.world + 64 * len(numels)) * elem + 2 * len(numels) * BLOCK + (1 << 20)

    def _units_in_cpu(self, numels: list[int]) -> set[int]:
        """stage3.max_in_cpu with parameters on nvme: the first units (`numels`: their sizes, in
        model order) whose shards of this rank add up to at most that many elements stay in host
        RAM, as DeepSpeed keeps its first parameter partitions in CPU memory up to max_in_cpu."""
        limit = self.config.stage3.max_in_cpu
        if not limit or not tier(self.config.tiers.params).needs_nvme_paths:
            return set()
        kept: set[int] = set()
        total = 0
        for i, numel in enumerate(numels):
            total += -(-numel // self.world)
            if total > limit:
                break
            kept.add(i)
        return kept

    def _check_budget(self, plan: Plan) -> None:
        """The largest set of units that must be gathered at once has to fit the live budget."""
        budget = self.config.stage3.live_budget_bytes
        for module, chain in plan.chains.items():
            units = [self.units[i] for i in chain if not self.units[i].resident]
            need = sum(u.nbytes for u in units)
            if need > budget and units:
                big = max(units, key=lambda u: u.nbytes)
                others = [u.name for u in units if u is not big]
                extra = f", {need} bytes with the units {others} gathered around it" if others else ""
                raise ConfigError(f"stage3.live_budget_bytes = {budget} is smaller than unit '{big.name}' "
                                  f"({big.nbytes} bytes gathered{extra}); raise the budget or use smaller units")

    def _materialize(self, u: Unit, filler: materialize.WeightFiller) -> None:
        """Full fp32 values of one unit -> this rank's master shard and compute-copy shard. Its
        groups (trainable, frozen) are filled in one call: a module with parameters in both (a
        frozen bias) is initialized only when all of them have a place to go."""
        # Page-aligned: with one process it is the shard an nvme tier writes straight to the drive.
        fulls = [aligned_tensor(g.layout.padded_numel, torch.float32).zero_() for g in u.groups]
        filler.fill([(n, p) for g in u.groups for n, p in zip(g.names, g.params)],
                    [v for g, full in zip(u.groups, fulls) for v in g.layout.views(full)],
                    [p.detach() for g in u.groups for p in g.params])
        for g, full in zip(u.groups, fulls):
            if filler.drew and self.world > 1:  # a random init may differ by rank: rank 0's wins
                full = comm.broadcast_(full.to(self.device), 0).cpu()  # on the device: NCCL needs it there
            lo, hi = g.layout.shard_range(self.rank)
            shard = full if self.world == 1 else full[lo:hi].clone()
            del full
            if g.trainable:
                self.shard_optimizer.add_shard(g.key, shard)
            u.write_shard(g.key, shard)
            u.settle_write(g.key)  # one shard in memory at a time: the model may exceed RAM
        u.empty_params()

    def _gather_resident(self) -> None:
        for u in self.units:
            if u.resident:
                u.gather()

    # ---- parameters read outside their unit's forward ----
    def _init_read_watch(self, model: nn.Module) -> None:
        """The tables ReadWatch needs: every sharded unit's parameters by id, and module names."""
        self._attached: dict[nn.Module, tuple[Unit, ...]] = {}  # units found read during a module's forward
        self._attached_new: list[tuple[str, int]] = []  # found this pass: (module name, unit index)
        self._read_units: set[int] = set()  # units read outside their module (see _held_to_end)
        self._owned = {id(p): (u, n) for u in self.units if not u.resident for g in u.groups
                       for n, p in zip(g.names, g.params)}
        self._names = {id(m): n for n, m in model.named_modules()}
        self._read_watch: hooks.ReadWatch | None = None
        self._recheck = False  # the next pass watches reads again (the last one changed order or failed)
        self._calls: list[tuple[nn.Module, list[Unit]]] = []  # hooked calls in progress, innermost last
        self._in_hook = False

    def units_of(self, module: nn.Module) -> tuple[Unit, ...]:
        """The units a module's call acquires: its own (unit_policy), then those found read in it."""
        return self.users.get(module, ()) + self._attached.get(module, ())

    def _start_read_watch(self) -> None:
        """A recording pass (no record yet, or the last pass added readers, changed order or
        failed) watches its forward's torch calls for parameters of released units."""
        schedule = self.prefetcher.schedule
        if schedule.recorded is None or self._recheck:
            self._read_watch = hooks.ReadWatch(self._owned, self._read_outside)
            self._read_watch.__enter__()

    def _stop_read_watch(self) -> None:
        watch, self._read_watch = self._read_watch, None
        if watch is None:
            return
        watch.owned = {}  # inert, even if a mode pushed after it (and never popped) keeps it below
        if torch.overrides._get_current_function_mode() is watch:
            watch.__exit__(None, None, None)

    def _forward_done(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._stop_read_watch()

    def _read_outside(self, param: torch.Tensor) -> None:
        """ReadWatch found `param` in a torch call's arguments. Its unit is released (no call in
        progress holds it): the read is outside the forward of the module that registers it, so
        the unit is gathered now for the innermost call in progress, and from now on acquired
        around that module's calls and gathered for their backward (autograd saved the weight).
        Every rank reads alike, so the on-demand gathers stay in step (check_same_unit)."""
        u, name = self._owned[id(param)]
        if self._in_hook or self.stage is not PassStage.FORWARD or not self._calls or self._unit_pass[u.index].refs:
            return
        module, extra = self._calls[-1]
        extra.append(u)
        if u not in self._attached.get(module, ()):
            self._attached[module] = self._attached.get(module, ()) + (u,)
            self._read_units.add(u.index)
            self._attached_new.append((self._names.get(id(module), "?"), u.index))
        try:
            self._acquire(u)
        except BudgetExceeded as exc:
            where = f"module '{self._names[id(module)]}'" if self._names.get(id(module)) else "the model"
            raise RuntimeError(f"stage 3: parameter '{name}' (unit '{u.name}') is read in the forward of {where}, "
                               f"outside its unit's module, and cannot be gathered there: {exc}; or name a module "
                               "class enclosing both in stage3.unit_modules") from None

    def adopt(self, name: str, module: nn.Module, indices: list[int], args: tuple, kwargs: dict,
              why: str, hint: str) -> tuple | None:
        """RootCheck: `module` runs while units holding its parameters are not gathered, since
        their root's forward does not run around it (a root calling a child's method,
        checkpoint_sequential, a reversible layer's backward). From this call on it acquires
        them around its calls and gathers them for its backward, as their root would; said once,
        in one line. A module already acquiring other units (its hooks ran for this call) keeps
        the refusal `why`."""
        if module in self.users:
            raise RuntimeError(why)
        units = tuple(self.units[i] for i in indices)
        self.users[module] = units
        handles, result = hooks.hook_module_now(module, self, args, kwargs)
        self._handles += handles
        if not self._adopted:
            warnings.warn(f"stage 3: '{name}' ({type(module).__name__}) ran while its unit '{units[0].name or '<root>'}' "
                          "was not gathered (the forward of the unit's root did not run around it), so such modules "
                          "now gather their unit around their own calls and training goes on; for fewer gathers "
                          f"{hint}", stacklevel=2)
        self._adopted.append(name)
        return result

    def _pop_call(self, module: nn.Module) -> list[Unit]:
        """The units gathered for `module`'s call in progress on demand; calls left open above it
        (a submodule whose forward raised, caught by the caller) are dropped."""
        while self._calls:
            m, extra = self._calls.pop()
            if m is module:
                return extra
        return []

    # ---- hook target ----
    def _counts_inputs(self, u: Unit) -> bool:
        """Whether a unit's uses are counted through the gradient of their inputs. A unit with
        frozen parameters: its trainable parameters' gradients (if any) can all be in while a
        frozen weight is still needed for the gradient of its inputs (LoRA: frozen base weights and
        trainable adapters in one block), so only the inputs' gradient says the weights may go. A
        routed unit (experts, Plan.routed) is also reduced then, never when its parameters have all
        reported: an expert no token reached on one rank reports on another, and the ranks would
        reduce it at different times."""
        return _has_frozen(u) or u.index in self._routed

    def wants_inputs_grad(self, units: Sequence[Unit]) -> bool:
        """A use of a unit that counts its inputs (_counts_inputs) is watched in forward, and in
        backward when it recomputes a use the forward made without grad (a reentrant checkpoint's)."""
        if self.stage is PassStage.BACKWARD:
            return any(self._unit_pass[u.index].unwatched for u in units)
        return any(self._counts_inputs(u) for u in units)

    def forward_enter(self, module: nn.Module, units: Sequence[Unit], watch: hooks.InputWatch | None) -> None:
        self._segment_end()
        self._in_hook = True
        try:
            if module is self.model and self.stage is not PassStage.BACKWARD:
                self._begin_pass()
            self._calls.append((module, []))
            if watch is not None:
                self._watches.append(watch)
            for u in units:
                self._count_use(u, watch is not None)
                self._pin_under_transform(u)
                if self.stage is PassStage.BACKWARD:  # checkpoint recomputation
                    rec = self._unit_pass[u.index]
                    if rec.held:
                        continue  # gathered for backward already; the recomputation may stop early and never exit
                    rec.recomputing = True
                self._acquire(u)
        finally:
            self._in_hook = False
        if module is self.model and self.stage is PassStage.FORWARD:
            self._start_read_watch()
        self._segment_start()

    def _pin_under_transform(self, u: Unit) -> None:
        """A unit used inside torch.func.vmap (or another functorch transform) with grad: the
        transform's outputs carry no hooks of ours, so nothing would gather the unit again for
        the backward of what the transform saved. It stays gathered until backward ends."""
        if (self.stage is PassStage.FORWARD and torch.is_grad_enabled() and u not in self._pinned
                and torch._C._functorch.maybe_current_level() is not None):
            self._pinned.append(u)
            self._acquire(u)

    def _unpin(self) -> None:
        pinned, self._pinned = self._pinned, []
        for u in pinned:
            if self._unit_pass[u.index].refs:
                self._unacquire(u)

    def _count_use(self, u: Unit, watched: bool) -> None:
        """A use of a unit with frozen parameters: watched ones are counted until their inputs'
        gradient comes; one made without grad in forward is remembered, so that its
        recomputation in backward (a reentrant checkpoint) is watched instead."""
        if not self._counts_inputs(u):
            return
        rec = self._unit_pass[u.index]
        if watched:
            rec.inputs_pending += 1
            rec.watched = True
            if self.stage is PassStage.BACKWARD:
                rec.unwatched -= 1
        elif self.stage is PassStage.FORWARD and not torch.is_grad_enabled():
            rec.unwatched += 1

    def forward_exit(self, module: nn.Module, units: Sequence[Unit]) -> tuple[Unit, ...]:
        """Releases what the call acquired; returns its units, with those it read on demand."""
        self._segment_end()
        self._in_hook = True
        try:
            used = tuple(units) + tuple(self._pop_call(module))
            for u in used:
                self._take_pass_edits(u)
                if self.stage is PassStage.BACKWARD:
                    rec = self._unit_pass[u.index]
                    if not rec.recomputing:
                        continue
                    rec.recomputing = False
                self._unacquire(u)
        finally:
            self._in_hook = False
        if module is not self.model or self.stage is PassStage.BACKWARD:
            self._segment_start()
        return used

    def _take_pass_edits(self, u: Unit) -> None:
        """In-place writes to a gathered unit's parameters during a call (Embedding(max_norm)'s
        renorm, an EMA update of a frozen copy) reach this rank's shards before the unit can be
        released, as eager torch keeps them: the compute-copy shard, and for trainable parameters
        the master's changed elements (moments kept, as after `gathered(modify=True)`). A write
        that changes a trainable value in backward, after its shard may have been stepped, is refused.
        One transaction (interrupts held): a Ctrl-C between the master and the compute copy would
        leave the two apart."""
        if u.state is not UnitState.GATHERED or not u.edited():
            return
        with held_interrupts():
            self._write_pass_edits(u)

    def _write_pass_edits(self, u: Unit) -> None:
        for g in u.groups:
            names = u.edited_names(g)
            if not names:
                continue
            u.take_replaced(g)
            lo, hi = g.layout.shard_range(self.rank)
            shard = g.flat[lo:hi].clone()
            changed = shard.ne(u.read_shard(g.key).to(shard.device))
            if not bool(changed.any()):
                continue  # a no-op write (a renorm of rows already within max_norm, a recomputation)
            if g.trainable and self.stage is PassStage.BACKWARD:
                raise RuntimeError(f"stage 3: parameter '{names[0]}' (unit '{u.name}') was changed in place during "
                                   "backward, after its shard may have been stepped; change it in forward or "
                                   "between steps inside `with engine.gathered(..., modify=True)`")
            if g.trainable:
                self.shard_optimizer.take_edit(g.key, shard, changed=changed)
            u.write_shard(g.key, shard)
            u.settle_write(g.key)
        u.note_gathered()

    def backward_enter(self, module: nn.Module, units: Sequence[Unit], node: Any = None) -> None:
        """An output of `module` (its autograd node `node`) is about to get its gradient: its units
        are gathered for its backward, unless finished."""
        self._require_engine_backward()
        self._segment_end()
        attached = self._attached.get(module, ())
        for u in units:
            rec = self._unit_pass[u.index]
            # A unit read by this module is done once its own gradient is: this module's backward may
            # come later (a read under no_grad), and needs none of its gradient then.
            if rec.finished and u.trainable is not None and u not in attached:
                # No frozen group (whose weights a later node may still read) and no path to the
                # trainable ones: this output was computed by other units, its gradient adds nothing here.
                if len(u.groups) == 1 and not hooks.reaches(node, u.trainable.params):
                    continue
                raise RuntimeError(_TWICE.format(unit=u.name, what="is needed for backward again"))
            if not rec.held and not rec.finished:
                rec.hold()
                self._acquire(u)
        self._segment_start()

    def inputs_grad(self, units: Sequence[Unit]) -> None:
        """The gradient of a counted use's inputs: a unit with frozen parameters is done with its
        weights once every use's has come (a frozen-only unit is then finished; a mixed one is
        let go if its trainable parameters have reported)."""
        self._segment_end()
        for u in units:
            rec = self._unit_pass[u.index]
            left = rec.inputs_pending
            if self._counts_inputs(u) and left > 0:
                rec.inputs_pending = left - 1
                if left == 1 and (u.trainable is None or u.index in self._routed):
                    self._finish_unit(u)
                elif left == 1 and rec.finished:
                    self._let_go(u)
        self._segment_start()

    def _require_engine_backward(self) -> None:
        if self.stage is not PassStage.BACKWARD:  # between begin_backward and end_backward
            raise RuntimeError("a gradient arrived outside engine.backward(): call engine.backward(loss), not "
                               "loss.backward(); at stage 3 torch.autograd.grad and double backward "
                               "(create_graph=True) are not supported either (stages 0-2 support them)")

    def param_grad(self, unit: Unit, param: torch.Tensor) -> None:
        self._require_engine_backward()
        self._segment_end()
        reported = self._unit_pass[unit.index].reported
        if id(param) in reported:  # a unit is reduced once all its parameters reported once
            raise RuntimeError(_TWICE.format(unit=unit.name, what="got a second gradient"))
        reported.add(id(param))
        if len(reported) == len(unit.trainable.params) and unit.index not in self._routed:
            self._finish_unit(unit)
        self._segment_start()

    # ---- acquire / release ----
    def _acquire(self, u: Unit) -> None:
        if u.resident:
            return
        rec = self._unit_pass[u.index]
        rec.refs += 1
        if rec.refs == 1:
            self.prefetcher.use(u)

    def _unacquire(self, u: Unit) -> None:
        if u.resident:
            return
        rec = self._unit_pass[u.index]
        rec.refs -= 1
        if rec.refs == 0:
            self._take_pass_edits(u)  # a write in backward (a hook's) too, before the release could drop it
            self.prefetcher.release(u)

    def _finish_unit(self, u: Unit) -> None:
        """The unit's backward is done: reduce its gradients and let it go."""
        rec = self._unit_pass[u.index]
        if rec.finished:
            return
        rec.finish()
        if u.trainable is not None:  # its reduce-scatter: ranks reduce units in their own backward's order
            check_same_unit(u, "reduce")
            complete = len(rec.reported) == len(u.trainable.params)  # else reduced after backward
            self.accumulator.note(u.trainable.key, () if complete else
                                  [i for i, p in enumerate(u.trainable.params) if p.grad is None])
        shard = u.reduce_grads(self.scale, aligned=not self.accumulator.store.addressable)  # a drive wants it aligned
        if shard is not None:  # off the boundary it only goes into the accumulation buffer
            shard = self.accumulator.add(u.trainable.key, shard, self.boundary)
        if shard is not None and self.accumulator.lacks(u.trainable.key):
            self._waiting.append((u, shard))  # maybe no gradient on any rank: see _step_incomplete
        elif shard is not None:
            self.shard_optimizer.grad_ready(u.trainable.key, shard, owned=True)
        if rec.inputs_pending == 0 and not self._held_to_end(u):
            self._let_go(u)  # else a frozen part may still be needed (see inputs_grad)

    def _held_to_end(self, u: Unit) -> bool:
        """A unit with frozen parameters that encloses other units and whose inputs nobody
        watches (the root, fed token ids): its frozen weights (ln_f under the blocks) may be
        needed until the end of backward, and only the end says so. A watched one goes when its
        inputs' gradient comes, after the backward of every unit inside it. Likewise a unit with
        frozen parameters that another module reads: that module's backward may need a frozen
        weight after the unit's own uses are done (and in the pass that finds the read, its
        use there is not counted)."""
        return self._counts_inputs(u) and (u.index in self._enclosing and not self._unit_pass[u.index].watched
                                           or u.index in self._read_units)

    def _let_go(self, u: Unit) -> None:
        """Backward needs the unit's weights no more."""
        rec = self._unit_pass[u.index]
        if rec.held:
            rec.let_go()
            self._unacquire(u)

    # ---- passes ----
    def _reset_pass(self) -> None:
        """Every unit's pass record anew, the last pass's input hooks and calls in progress gone."""
        for watch in self._watches:  # the last pass's input hooks (see hooks.InputWatch)
            watch.remove()
        self._watches = []
        self._pinned = []  # their refs go with the pass records below
        self._unit_pass = [UnitPass(u) for u in self.units]  # every unit's pass state, by index
        self._seg: int | None = None
        self._stop_read_watch()  # a forward that raised (its always-called hook ends it too)
        self._calls = []
        if self._attached_new:  # a failed pass found readers: the record no longer says what comes when
            self._attached_new = []
            self.prefetcher.schedule.forget()

    def _begin_pass(self) -> None:
        self._unpin()  # an evaluation forward under a transform: no backward released them
        if self.stage is PassStage.FORWARD and self.units_in_use():
            self.prefetcher.release_all()  # the previous forward raised part way: what it held goes
            self._recheck = True  # a read the watch was off for may be why
        elif self.stage is PassStage.FORWARD:  # the previous pass had no backward (evaluation)
            self._end_pass()
        self._reset_pass()
        self.prefetcher.begin_pass()
        self._to_stage((PassStage.CLOSED, PassStage.FORWARD), PassStage.FORWARD)

    def begin_backward(self, boundary: bool) -> None:
        """Checks first (nothing is reduced yet): the parameters and which of them train are
        fixed at initialize. A stale .grad (held before initialize, or left by a refused
        loss.backward()) would be summed into this backward's by autograd: dropped."""
        check_bindings(self.bindings)  # a parameter replaced, frozen or unfrozen since initialize
        if self.gathering:  # its step would leave the block's gathered copies stale (and modify=True revert it)
            raise RuntimeError("engine.backward inside engine.gathered(): gathered blocks are for reading, editing "
                               "and forward passes (evaluation, generate); train outside the block")
        for u in self.units:
            for p in u.params():
                p.grad = None
        self._segment_end()  # a forward segment still open (a unit's module called after the model)
        self._to_stage((PassStage.CLOSED, PassStage.FORWARD), PassStage.BACKWARD)
        self.boundary = boundary

    def end_backward(self) -> None:
        """After loss.backward(): reduce every unit that did not finish, in unit order; end the pass."""
        self._segment_end()
        for u in self.units:
            rec = self._unit_pass[u.index]
            if not rec.finished and (u.trainable is not None or rec.held):
                self._finish_unit(u)
            self._let_go(u)  # a mixed unit whose inputs' gradient never came (nothing upstream wanted it)
        self._unpin()
        leaked = [u.name for u in self.units if u.state is not UnitState.SHARDED and not u.resident]
        if leaked:
            raise RuntimeError(f"stage 3: units {leaked} are still gathered after backward")
        if self._root_check is not None:
            self._root_check.backward_done()
            self._root_check = None
        if self.boundary:
            self._step_incomplete()
        self._end_pass()
        self._to_stage((PassStage.BACKWARD,), PassStage.CLOSED)
        if not self.boundary:  # no step follows: the shards the next pass reads are final already
            self.prefetcher.warm_start()
        self.boundary = True

    def _step_incomplete(self) -> None:
        """On the boundary: agree on the parameters no rank had a gradient for in the cycle (every
        rank, every step), then hand the units that were incomplete here to the step without them."""
        agreed = self.accumulator.agree()
        waiting, self._waiting = self._waiting, []
        for u, shard in waiting:
            key = u.trainable.key
            missing = missing_ranges(u.trainable.layout, self.rank, agreed.get(key, ()))
            self.shard_optimizer.grad_ready(key, shard, owned=True, missing=missing)

    def _end_pass(self) -> None:
        """The ranks agree on the pass's order and on the readers it found (they gather alike from
        now on). A pass that found readers is not kept as the record: the next pass acquires them
        around the reading module's calls, so it records again (with the watch on)."""
        found, self._attached_new = self._attached_new, []
        schedule = self.prefetcher.schedule
        before = schedule.rerecorded
        self.prefetcher.end_pass(found)
        self._recheck = schedule.rerecorded != before  # control flow changed: watch the next pass's reads too
        if found:
            schedule.forget()

    def backward_touched(self) -> bool:
        """After a failed backward: whether a unit's gradient had been reduced (summed into a
        partial sum, or handed to the step)."""
        return any(r.finished and r.unit.trainable is not None for r in self._unit_pass)

    def abort_backward(self) -> None:
        """After a failed backward: nothing more is reduced or stepped, the gradients autograd
        left behind are dropped and every unit the pass holds goes back to SHARDED; the shards
        already handed to the step are finished as after a failed step."""
        self._segment_end()
        for u in self.units:
            for p in u.trainable.params if u.trainable is not None else ():
                p.grad = None
        if self.backward_touched():  # a cycle that took part of this backward is not gone on with
            self.accumulator.forget_cycle()
        self._waiting = []
        try:
            self.prefetcher.release_all()
        finally:  # a read ahead that failed is reported, after the pass is reset all the same
            self._reset_pass()
            self.stage, self.boundary = PassStage.CLOSED, True  # from any stage: whatever the pass had reached
            self._abandon_step()

    def _abandon_step(self) -> None:
        """The shards handed to the step during the failed backward, finished and installed."""
        try:
            self.shard_optimizer.abandon_step()
        finally:
            if self.world == 1:
                self._regather_resident()  # resident units take the shards the worker did step
            else:  # a collective only this rank would issue: they are installed at the next step
                self._fresh = {}

    def _segment_start(self) -> None:
        """Model compute runs between two hooks: the time from a hook's end to the next hook's start."""
        if tracer().enabled and self.stage is not PassStage.CLOSED:
            self._seg = time.perf_counter_ns()

    def _segment_end(self) -> None:
        if self._seg is not None:
            tracer().add(self.stage.value, "compute", self._seg, time.perf_counter_ns())
            self._seg = None

    # ---- step ----
    def step(self) -> bool:
        with tracer().span("optimizer step", "optimizer"):
            applied = self.shard_optimizer.finish_step(defer_interrupt=True)
        if applied:
            self._regather_resident()
        self.prefetcher.warm_start()
        self.shard_optimizer.prefetch()  # the optimizer's reads for the next step start now
        return applied

    def _on_updated(self, key: str, shard: torch.Tensor, owned: bool = False) -> None:
        """On the step worker: start writing the new compute-copy shard (the next read of the key
        waits for it); a resident unit keeps it to install at step(). A shard that is the
        optimizer's own master (`owned` False), which the next step rewrites in place, is
        written to the end at once."""
        unit, _ = self.by_key[key]
        with tracer().span(f"write {unit.name}", "transfer"):
            unit.write_shard(key, shard)
            if not owned:
                unit.settle_write(key)
        self._writing.append((unit, key))
        while len(self._writing) > WRITES_IN_FLIGHT:  # bounds the updated shards held in memory
            old, old_key = self._writing.popleft()
            old.settle_write(old_key)
        if unit.resident:  # it stays gathered: install the new values directly, no read back
            self._fresh[key] = shard

    def _regather_resident(self) -> None:
        """Resident units after a step: this rank's new shard into its part, then all-gather."""
        fresh, self._fresh = self._fresh, {}
        for u in self.units:
            if u.resident:
                u.install_shards({g.key: fresh.get(g.key) for g in u.groups})

    def refresh_params(self) -> None:
        """Compute-copy shards from the master shards (after a checkpoint load). Units read ahead
        after the last step, or left gathered, are let go first: they hold the old values."""
        self.prefetcher.release_all()
        for key, (unit, g) in self.by_key.items():
            if g.trainable:
                unit.write_shard(key, self.shard_optimizer.master(key), replacing=True)  # supersedes a failed write
                unit.settle_write(key)
        self._fresh = {}
        for u in self.units:
            if u.resident:  # frozen groups too: a checkpoint load may have rewritten them
                u.install_shards({}, frozen_too=True)

    def write_frozen(self, key: str, values: torch.Tensor) -> None:
        """Replace the compute-copy shard of a frozen group (a checkpoint load); refresh_params,
        which follows every load, re-gathers resident units."""
        unit, g = self.by_key[key]
        if g.trainable:
            raise KeyError(f"stage 3: {key!r} is trainable; its values come from the optimizer's master shard")
        self.prefetcher.release_all()  # no read ahead of the shard may run beside this write
        unit.write_shard(key, values, replacing=True)
        unit.settle_write(key)

    def read_frozen(self, key: str) -> torch.Tensor:
        """This rank's compute-copy shard of a frozen group (what a checkpoint saves)."""
        unit, _ = self.by_key[key]
        return unit.read_shard(key)

    def gathers_updates(self) -> bool:
        """No: each updated shard streams to the params tier as it is stepped."""
        return False

    # ---- descriptions for checkpoints and the memory report ----
    def _trainable(self) -> list[tuple[Unit, FlatGroup]]:
        return [(u, u.trainable) for u in self.units if u.trainable is not None]

    def shard_map(self) -> dict[str, list[tuple[str, int, int, int]]]:
        return {g.key: self._pieces(g) for _, g in self._trainable()}

    def frozen_map(self) -> dict[str, list[tuple[str, int, int, int]]]:
        """Like shard_map, for the frozen groups inside units: their compute copy is their only
        copy, so checkpoints save it from here (sharded, resharded on load like the rest)."""
        return {g.key: self._pieces(g) for u in self.units for g in u.groups if not g.trainable}

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(s) for u in self.units for g in u.groups if not g.trainable
                for n, s in zip(g.names, g.layout.shapes)}

    def _pieces(self, g: FlatGroup) -> list[tuple[str, int, int, int]]:
        return pieces_of(g.names, g.layout, self.rank)

    def shards_frozen(self) -> bool:
        """Frozen parameters inside units live in their units' shards (frozen_map)."""
        return True

    def held_params(self) -> set[int]:
        """Every unit's parameters: empty tensors between passes, their values in the shards."""
        return {id(p) for u in self.units for g in u.groups for p in g.params}

    def flat_sources(self) -> list[FlatSource]:
        """Each unit's groups: trainable from the fp32 master shard, frozen from the compute copy."""
        so = self.shard_optimizer
        return [FlatSource(g.layout, g.params, torch.float32 if g.trainable else self.dtype,
                           partial(so.master, g.key) if g.trainable else partial(u.read_shard, g.key))
                for u in self.units for g in u.groups]

    def consolidated(self, orig_dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """consolidated_state_dict on rank 0 (every rank gathers), frozen values and buffers in
        the model's own dtypes; {} elsewhere."""
        return consolidate(self.model, self.flat_sources(), self.device, keep=self.rank == 0, orig_dtypes=orig_dtypes)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(s) for _, g in self._trainable() for n, s in zip(g.names, g.layout.shapes)}

    def trainable_numel(self) -> int:
        return sum(g.layout.numel for _, g in self._trainable())

    def retained(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(bytes held now, high-water mark) by (group, tier): the params tier holds the compute-copy
        shards; gathered units are reported by extras()."""
        held: dict[tuple[str, str], tuple[int, int]] = {}
        for tier_name, store in ((self.config.tiers.params, self.params_store), (CPU.name, self.params_cpu_store)):
            if store is not None:  # frozen shards are not in the ledger's weights: extras() names them
                frozen = self._frozen_shard_bytes(store)
                held[("weights", tier_name)] = (store.bytes_retained() - frozen, store.peak_bytes() - frozen)
        return {**held, **self.state_retained()}

    def _frozen_shard_bytes(self, store: Any = None) -> int:
        """Frozen groups' shard bytes, of the units in `store` (None: every unit)."""
        return sum(g.layout.shard_numel * g.flat.element_size() for u in self.units for g in u.groups
                   if not g.trainable and (store is None or u.store is store))

    def extras(self) -> dict[str, float]:
        """The shard optimizer's and the gradients' rows (RuntimeBase.state_extras), then the
        compute copy's: its padding, slot rounding, frozen shards, gathered units, staging."""
        s, trainable = self.stats(), [g for _, g in self._trainable()]
        groups = [g for u in self.units for g in u.groups]
        shards = sum(g.layout.shard_numel * g.flat.element_size() for g in groups)
        in_cpu = sum(g.layout.shard_numel * g.flat.element_size() for u in self.units for g in u.groups
                     if u.store is self.params_cpu_store)
        rounding = self.params_store.bytes_retained() - (shards - in_cpu) if not self.params_store.addressable else 0
        return {**self.state_extras({g.key: g.layout for g in trainable}),
                "padding (weights)": padding({g.key: g.layout.shard_numel * g.flat.element_size() for g in trainable},
                                             {g.key: g.layout for g in groups}),
                "NVMe slot rounding (params)": rounding, FROZEN_ROW: self._frozen_shard_bytes(),
                "gathered units (peak, stage 3)": s["peak_gathered_bytes"],
                "resident units (stage 3)": s["resident_bytes"],
                "staging buffers (params)": self.gather_buffers.nbytes}

    def limits(self) -> dict[str, int]:
        """Configured bounds (not memory held), shown apart in the memory report."""
        return {"live budget (stage 3)": self.prefetcher.budget.limit}

    def stats(self) -> dict[str, int]:
        p = self.prefetcher
        return {"live_budget_bytes": p.budget.limit, "gathered_bytes": p.budget.live,
                "peak_gathered_bytes": p.budget.peak, "on_demand_fetches": p.on_demand,
                "rerecorded_passes": p.schedule.rerecorded, "units": len(self.units),
                "read_elsewhere": sum(len(v) for v in self._attached.values()),
                "resident_bytes": sum(u.nbytes for u in self.units if u.resident)}

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with full values on every rank: fp32 masters for trainable
        parameters, the compute copy for frozen ones, buffers as they are. Collective."""
        return consolidate(self.model, self.flat_sources(), self.device, keep=True)

    def close(self) -> None:
        """Also what a failed __init__ made (the parts it did not reach are None)."""
        if self._root_check is not None:
            self._root_check.remove()
        for h in self._handles:
            h.remove()
        if getattr(self, "_read_watch", None) is not None:
            self._stop_read_watch()
        steps = [self.prefetcher.close] if self.prefetcher is not None else []
        if self.shard_optimizer is not None:
            steps += [self.shard_optimizer.close, self._settle_writes]
        close_in_order(steps, [self.accumulator, self.params_store, self.params_cpu_store])

    def _settle_writes(self) -> None:
        for u in self.units:
            u.settle_writes()
