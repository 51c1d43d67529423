"""Initial weights for stage 3, one unit at a time, so no more than one unit is ever whole in RAM.

A model may be built normally (its parameters hold the weights), or on the meta device (nothing
allocated). For a meta model the weights come from files (`weights=`: a .safetensors file, a torch
state dict, a Hugging Face index of shards or a folder holding one, all memory-mapped and read
lazily, or a WeightSource producing each tensor on request: weights_files.py), or from the
initialization an eager build runs, unit by unit:
1. each module's own `reset_parameters()` (what its constructor ran);
2. the model's own initialization, for a transformers-style model: the nearest enclosing module
   that has `_init_weights(module)` and `initialize_weights()`/`init_weights()` (a PreTrainedModel,
   found by duck typing: the core never imports transformers) has `_init_weights` called on
   each module below it, children before parents, as its `post_init` does;
3. `init_fn(module)`, children before parents, as `model.apply(init_fn)` after construction.
"As the eager build" means: the same initializers on the same tensors in the same order per
tensor, hence the same distributions (and the same constants: norms at one, biases at zero);
not the same random numbers, since the eager build draws every constructor's numbers first.

Modules added to a transformers model after its construction (a PEFT adapter; added_modules)
have an initialization of their own, which the engine cannot know: without weights they are
refused unless init_fn is given (which then initializes them after their reset_parameters).

A parameter no initializer writes is refused at initialize, naming it (it would otherwise start
at zero, or hold whatever memory held): every parameter of a unit starts at NaN and must not
be NaN after the unit's inits. With weights, a transformers-style model's `_init_weights` still
computes the buffers the weights do not hold (non-persistent ones), on the modules holding them,
as transformers' loader does. With a WeightSource whose `init_missing` is true (the
transformers loader's, zero_offload.hf.from_pretrained), a tensor the source does not hold is
initialized as transformers' own loader does: the model's `_init_weights` alone (transformers
builds on the meta device too, so no constructor ran), run on the modules whose subtree holds a
tensor the source lacks; the loaded tensors are marked `_is_hf_initialized` for the call (which
transformers' init functions honour) and read again if an init wrote them anyway.

Meta parameters cannot take real data in place (torch refuses `.data =` across the meta device),
so they are replaced by new nn.Parameter objects, once, in every module that registers them:
tied weights stay one object. The model's parameter objects change; keep the model, not them.

A module is initialized in each unit holding a parameter of its subtree that it (or a module
below it) registered first; the subtree's parameters of other units are meta stand-ins for the
call (an init reads shapes: fan-in), so what it writes there is dropped and written for real in
that parameter's own unit, by the same call there. A parameter borrowed from a module outside
the subtree (the tied LM head's weight) keeps its first owner's values, as in eager construction
where the tie replaces the head's own weight after its init. Modules with no parameter at all
are initialized after every unit (a rotary embedding).

Buffers are given their values before any init runs (meta_buffers.py: from the weights, or from
the module's own constructor run again on the CPU; under a transformers-style model, from its
`_init_weights`), so what an init writes wins; a meta buffer nothing wrote fails initialize, naming it.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from zero_offload.engine.model.meta_buffers import MetaBuffers
# The weight files' readers live in weights_files.py; their names stay importable from here.
from zero_offload.engine.model.weights_files import (Weights, load_safetensors, one_line, open_source,  # noqa: F401
                                                 open_weights, save_safetensors)

InitFn = Callable[[nn.Module], None]
LOADED_FLAG = "_is_hf_initialized"  # transformers' init functions leave a tensor carrying it alone


def default_init(module: nn.Module) -> None:
    """The module's own initialization: reset_parameters, or the private _reset_parameters some
    torch modules use instead (nn.MultiheadAttention's in_proj_weight)."""
    reset = _reset_of(module)
    if reset is not None:
        reset()


def _reset_of(module: nn.Module) -> Callable[[], None] | None:
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def has_model_init(module: nn.Module) -> bool:
    """Whether `module` initializes the modules below it as a transformers PreTrainedModel does:
    `_init_weights(module)`, driven by `initialize_weights()` (or `init_weights()`) in its post_init."""
    cls = type(module)  # its class's: a wrapper forwarding attributes (a PeftModel) is not the model
    return callable(getattr(cls, "_init_weights", None)) and (
        callable(getattr(cls, "initialize_weights", None)) or callable(getattr(cls, "init_weights", None)))


def model_inits(model: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the nearest module at or above it with a model init (has_model_init), for
    every module that has one: a sub-model (a vision tower) initializes what is below it."""
    owner: dict[int, nn.Module] = {}

    def walk(module: nn.Module, above: nn.Module | None) -> None:
        here = module if has_model_init(module) else above
        if here is not None:
            owner[id(module)] = here
        for child in module.children():
            if id(child) not in owner:
                walk(child, here)
    walk(model, None)
    return owner


def added_modules(model: nn.Module, owners: Mapping[int, nn.Module]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module under an outermost transformers-style model that its class,
    built again from its config (on the meta device: nothing allocated, nothing drawn), does not
    make there: a module added after construction (a PEFT adapter, the layer it wraps), which that
    model's `_init_weights` never saw in an eager build. Unchecked where it cannot be built so."""
    out: list[tuple[str, nn.Module]] = []
    for name, top in model.named_modules():
        parent = name.rpartition(".")[0] if name else None
        if owners.get(id(top)) is not top or (parent is not None and owners.get(id(model.get_submodule(parent)))):
            continue  # not an outermost model
        try:
            with torch.device("meta"), torch.random.fork_rng(devices=[]):
                fresh = dict(type(top)(top.config).named_modules())
        except Exception:  # noqa: BLE001 - a constructor taking more than its config: not checked
            continue
        for sub_name, sub in top.named_modules():
            if sub_name not in fresh or type(fresh[sub_name]) is not type(sub):
                out.append((f"{name}.{sub_name}".strip("."), sub))
    return out


def post_order(model: nn.Module) -> list[nn.Module]:
    """Every module once, children before their parent (as model.apply and post_init visit them)."""
    seen: set[int] = set()
    out: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                walk(child)
        out.append(module)
    walk(model)
    return out


def replace_meta_params(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[int, nn.Parameter]:
    """Give every meta parameter a real (empty) replacement, in every module that registers it;
    returns id(old parameter) -> its replacement."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
    return new


def _registrations(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Parameter]]:
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                yield sub, name, p


class WeightFiller:
    """Fills a unit's full fp32 values, parameter by parameter, from the chosen source."""

    def __init__(self, model: nn.Module, *, meta: bool, init_fn: InitFn | None,
                 weights: Mapping[str, torch.Tensor] | None, source: str,
                 shapes: Mapping[int, torch.Size] | None = None) -> None:
        """`shapes` (id(parameter) -> shape) gives the shape of a parameter that is an empty
        placeholder (its unit not filled yet, or filled and sharded)."""
        self.model, self.meta, self.init_fn, self.weights, self.source = model, meta, init_fn, weights, source
        self.shapes = dict(shapes or {})
        self.init_missing = meta and weights is not None and bool(getattr(weights, "init_missing", False))
        self.owners = model_inits(model)
        self.first_owner: dict[int, nn.Module] = {}
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    self.first_owner.setdefault(id(p), module)
        self.order = post_order(model)
        self.added: set[int] = set()  # modules the model's _init_weights does not initialize (added_modules)
        if meta and weights is None and self.owners:
            self._check_added(added_modules(model, self.owners))
        # id(module) -> ids of the parameters first registered in its subtree: a module is
        # initialized in each unit holding one of them.
        self.owned: dict[int, set[int]] = {}
        for module in self.order:
            mine = {id(p) for p in module._parameters.values() if p is not None and self.first_owner[id(p)] is module}
            self.owned[id(module)] = mine.union(*(self.owned[id(c)] for c in module.children()))
        self.initialized: set[int] = set()  # id of every module an init was called on
        self.drew = False  # whether the last fill's values may differ by rank (an init ran, or a live build)
        self._stand_ins: dict[int, nn.Parameter] = {}  # id(parameter) -> its meta stand-in (_call)
        self._inside: dict[int, set[int]] = {}  # id(module) -> id of every module of its subtree (_call)
        # Buffers get their values now, before any init runs: an init that writes a buffer (a
        # BatchNorm's reset_running_stats) writes over the constructor's value, as in eager construction.
        self.buffers = MetaBuffers(model, weights, source, self.shapes,
                                   governed={k: type(v).__name__ for k, v in self.owners.items()})
        held = self.buffers.placeholder_modules()
        self.waiting: dict[int, bool] = {}  # id(module) -> a placeholder buffer in its subtree
        for module in self.order:
            self.waiting[id(module)] = id(module) in held or any(self.waiting[id(c)] for c in module.children())

    def finish(self, device: torch.device, dtype: torch.dtype) -> None:
        """After every unit is filled: the inits of the modules holding no parameters at all (a
        rotary embedding; as model.apply(init_fn) would reach them), then every buffer checked
        to have a value and moved to `device` (floating ones in `dtype`, the compute dtype)."""
        if self.meta:
            idle = [m for m in self.order if next(m.parameters(), None) is None
                    and (self.weights is None or self.waiting[id(m)])]
            self._phases(idle, set(), set())
        self.buffers.finish(device, self.initialized, dtype)

    def fill(self, named: list[tuple[str, nn.Parameter]], views: list[torch.Tensor], live: list[torch.Tensor | None]) -> None:
        """views[i] (fp32, shaped) receives the initial value of named[i]; live[i] is its current data."""
        self.drew = False
        if self.weights is not None:
            missing = []
            for (name, p), view in zip(named, views):
                if self.init_missing and name not in self.weights:
                    missing.append(id(p))
                else:
                    view.copy_(self._lookup(name, view.shape))
            if self.meta:  # the model's init still computes its buffers (and with init_missing, what is missing)
                self._run_init(named, views, set(missing))
        elif not self.meta:
            for view, value in zip(views, live):
                view.copy_(value)
            self.drew = True  # each rank's own build (its own seed): rank 0's values win, as DDP's do
        else:
            self._run_init(named, views, {id(p) for _, p in named})

    def _lookup(self, name: str, shape: torch.Size) -> torch.Tensor:
        if name not in self.weights:
            some = ", ".join(list(self.weights)[:3])
            raise KeyError(f"weights file {self.source} has no tensor '{name}' (it has {len(self.weights)}: {some}, ...)")
        t = self.weights[name]
        if t.shape != shape:
            raise ValueError(f"weights file {self.source}: '{name}' has shape {tuple(t.shape)}, the model expects {tuple(shape)}")
        return t

    def _run_init(self, named: list[tuple[str, nn.Parameter]], views: list[torch.Tensor], pending: set[int]) -> None:
        """Point the parameters at the fp32 views, NaN those to initialize (`pending`), run the
        inits of every module holding one of this unit's parameters (with the transformers
        loader's source: only of those whose subtree has a tensor to initialize), then refuse a
        pending parameter still NaN, naming it."""
        in_unit = {id(p) for _, p in named}
        for (_, p), view in zip(named, views):
            p.data = view
            if id(p) in pending:
                view.fill_(math.nan)
        modules = [m for m in self.order if not self.owned[id(m)].isdisjoint(in_unit)
                   and (self.weights is None or self.waiting[id(m)] or not self.owned[id(m)].isdisjoint(pending))]
        self.drew = bool(pending)  # what an init draws may differ by rank
        if modules:
            loaded = {id(p): (name, view) for (name, p), view in zip(named, views) if id(p) not in pending}
            self._phases(modules, in_unit, loaded)
        for (name, p), view in zip(named, views):
            if id(p) in pending and torch.isnan(view).any():
                raise ValueError(self._unset(name, self.first_owner[id(p)]))

    def _phases(self, modules: list[nn.Module], in_unit: set[int], loaded: Mapping[int, tuple[str, torch.Tensor]]) -> None:
        """As an eager build: every module's constructor init, then the model's `_init_weights`
        on each, then init_fn on each. With weights, as transformers' loader: the model's
        `_init_weights` only (for a plain torch model: its reset_parameters, where the source
        lets what it lacks be initialized; else nothing)."""
        steps: list[Callable[[nn.Module], None]] = []
        if self.weights is None:
            steps = [default_init, self._model_init] + ([self.init_fn] if self.init_fn is not None else [])
        elif self.owners:
            steps = [self._model_init]
        elif self.init_missing:
            steps = [default_init]
        for step in steps:
            for module in modules:
                self._call(step, module, in_unit, loaded)

    def _check_added(self, added: list[tuple[str, nn.Module]]) -> None:
        """Modules added to a transformers model after its construction have an initialization
        of their own that the engine cannot know (LoRA's B starts at zero): refused unless
        init_fn initializes them (after their reset_parameters; the model's _init_weights is not
        called on them, as in an eager build)."""
        with_params = [(n, m) for n, m in added if any(True for _ in m.parameters(recurse=False))]
        if with_params and self.init_fn is None:
            name, module = with_params[0]
            more = f" (and {len(with_params) - 1} more)" if len(with_params) > 1 else ""
            raise ValueError(f"initialize: module '{name}' ({type(module).__name__}){more} of the meta-device model is "
                             f"not one its transformers model builds from its config (added after construction, as "
                             "an adapter is), so how an eager build initializes it is unknown: pass weights=, or an "
                             "init_fn that initializes it, or build the model off the meta device")
        self.added = {id(m) for _, m in added}

    def _model_init(self, module: nn.Module) -> None:
        owner = self.owners.get(id(module))
        if owner is not None and id(module) not in self.added:
            owner._init_weights(module)

    def _call(self, step: InitFn, module: nn.Module, in_unit: set[int], loaded: Mapping[int, tuple[str, torch.Tensor]]) -> None:
        """One init of one module, with its subtree's parameters of other units as meta stand-ins,
        borrowed ones (tied, first registered outside it) kept as they are, and loaded ones
        marked as loaded, and read again should the init write them anyway."""
        if id(module) not in self._inside:
            self._inside[id(module)] = set(map(id, module.modules()))
        inside = self._inside[id(module)]
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        kept: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        marked: dict[int, tuple[nn.Parameter, int]] = {}
        for sub, name, p in _registrations(module):
            if id(p) not in in_unit:
                sub._parameters[name] = self._stand_in(p)
                swapped.append((sub, name, p))
            elif id(self.first_owner[id(p)]) not in inside:
                kept.setdefault(id(p), (p, p.data.clone()))
            elif id(p) in loaded and id(p) not in marked:
                setattr(p, LOADED_FLAG, True)
                marked[id(p)] = (p, p._version)
        self.initialized.add(id(module))
        try:
            with torch.no_grad():
                step(module)
        except Exception as exc:
            if not swapped:
                raise
            raise RuntimeError(self._failed(module, swapped, exc)) from None
        finally:
            for sub, name, p in swapped:
                sub._parameters[name] = p
            for p, old in kept.values():
                p.data.copy_(old)
            for key, (p, version) in marked.items():
                delattr(p, LOADED_FLAG)
                if p._version != version:
                    name, view = loaded[key]
                    with torch.no_grad():
                        view.copy_(self._lookup(name, view.shape))

    def _stand_in(self, p: nn.Parameter) -> nn.Parameter:
        """A meta parameter of p's shape, made once (a spanning module is called in every unit)."""
        if id(p) not in self._stand_ins:
            shape = self.shapes.get(id(p), p.shape)
            self._stand_ins[id(p)] = nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                                  requires_grad=p.requires_grad)
        return self._stand_ins[id(p)]

    def _name(self, module: nn.Module) -> str:
        return next((n for n, m in self.model.named_modules() if m is module), "") or "<root>"

    def _failed(self, module: nn.Module, swapped: list, exc: Exception) -> str:
        return (f"initialize: the initialization of '{self._name(module)}' ({type(module).__name__}) raised "
                f"{one_line(exc)}; its parameters span several stage-3 units and those of the other units "
                f"(such as '{swapped[0][1]}' of {type(swapped[0][0]).__name__}) are absent during it: name "
                "the module in stage3.unit_modules to make it one unit, or pass weights=")

    def _unset(self, name: str, module: nn.Module) -> str:
        """The one line for a parameter no initializer wrote."""
        tried = [f"{type(module).__name__}.reset_parameters()"] if _reset_of(module) is not None else []
        owner = self.owners.get(id(module))
        if owner is not None:
            tried.append(f"{type(owner).__name__}._init_weights")
        if self.init_fn is not None:
            tried.append("init_fn")
        why = (f"neither {' nor '.join(tried)} sets it" if tried else
               f"{type(module).__name__} has no reset_parameters() and no init_fn was given")
        if self.weights is not None:
            return (f"initialize: parameter '{name}' ({type(module).__name__}) is not in {self.source} and the "
                    f"model's own initialization does not set it ({why}); add it to the folder")
        return (f"initialize: parameter '{name}' ({type(module).__name__}) of the meta-device model has no initial "
                f"value: {why}; pass weights=, or an init_fn that sets it, or build the model off the meta device")
