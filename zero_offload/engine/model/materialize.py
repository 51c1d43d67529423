"""Initial weights for stage 3, one unit at a time, so no more than one unit is ever whole in RAM.

A model may be built normally (its parameters hold the weights), or on the meta device (nothing
allocated). For a meta model the weights come from files (`weights=`: a .safetensors file, a torch
state dict, a Hugging Face index of shards or a folder holding one, all memory-mapped and read
lazily, or a WeightSource producing each tensor on request: weights_files.py), or from an init
function called on each module (default: its `reset_parameters()`), in module order.

Meta parameters cannot take real data in place (torch refuses `.data =` across the meta device),
so they are replaced by new nn.Parameter objects, once, in every module that registers them:
tied weights stay one object. The model's parameter objects change; keep the model, not them.

With an init function, each module that is the first to register at least one of its parameters
is initialized, once the unit holding those parameters is filled. A parameter it shares with a
module that registered it first (the tied LM head's weight) keeps that module's values, as in
eager construction where the tie replaces the head's own weight after its init; the head's own
bias is initialized all the same. A module with parameters below it but none of its own is
initialized once all of them are in the unit being filled (never, when they span several units),
and a module with no parameters at all after every unit, as model.apply(init_fn) reaches both.

Buffers are given their values before any init runs (meta_buffers.py: from the weights, or from
the module's own constructor run again on the CPU), so what an init writes wins; a meta buffer
nothing wrote fails initialize, naming it.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from zero_offload.engine.model.meta_buffers import MetaBuffers
# The weight files' readers live in weights_files.py; their names stay importable from here.
from zero_offload.engine.model.weights_files import (Weights, load_safetensors, open_source,  # noqa: F401
                                                 open_weights, save_safetensors)

InitFn = Callable[[nn.Module], None]


def default_init(module: nn.Module) -> None:
    """The module's own initialization: reset_parameters, or the private _reset_parameters some
    torch modules use instead (nn.MultiheadAttention's in_proj_weight)."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


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


class WeightFiller:
    """Fills a unit's full fp32 values, parameter by parameter, from the chosen source."""

    def __init__(self, model: nn.Module, *, meta: bool, init_fn: InitFn | None,
                 weights: Mapping[str, torch.Tensor] | None, source: str,
                 shapes: Mapping[int, torch.Size] | None = None) -> None:
        """`shapes` (id(parameter) -> shape) lets a module be initialized while a parameter it
        borrows lives in a unit not filled yet (that parameter is then an empty placeholder)."""
        self.model, self.meta, self.init_fn, self.weights, self.source = model, meta, init_fn, weights, source
        self.shapes = dict(shapes or {})
        self.first_owner: dict[int, nn.Module] = {}
        self.modules: list[nn.Module] = []
        for module in model.modules():
            direct = [p for p in module._parameters.values() if p is not None]
            for p in direct:
                self.first_owner.setdefault(id(p), module)
            if any(self.first_owner[id(p)] is module for p in direct):
                self.modules.append(module)
        # Modules with parameters below them but none of their own (an attention block holding
        # its projections and a rotary buffer): initialized once their whole subtree is in the
        # unit being filled, after what is below them, as model.apply(init_fn) goes.
        self.containers = [m for m in reversed(list(model.modules()))
                           if all(p is None for p in m._parameters.values()) and next(m.parameters(), None) is not None]
        self.initialized: set[int] = set()  # id of every module the init was called on
        # Buffers get their values now, before any init runs: an init that writes a buffer (a
        # BatchNorm's reset_running_stats) writes over the constructor's value, as in eager construction.
        self.buffers = MetaBuffers(model, weights, source, self.shapes)

    def finish(self, device: torch.device, dtype: torch.dtype) -> None:
        """After every unit is filled: the init of the modules holding no parameters at all (a
        rotary embedding; as model.apply(init_fn) would reach them), then every buffer checked
        to have a value and moved to `device` (floating ones in `dtype`, the compute dtype)."""
        if self.meta and self.weights is None:
            with torch.no_grad():
                for module in reversed(list(self.model.modules())):  # below before above, as model.apply
                    if next(module.parameters(), None) is None:
                        self._init_keeping(module, [], set())
        self.buffers.finish(device, self.initialized, dtype)

    def fill(self, named: list[tuple[str, nn.Parameter]], views: list[torch.Tensor], live: list[torch.Tensor | None]) -> None:
        """views[i] (fp32, shaped) receives the initial value of named[i]; live[i] is its current data."""
        if self.weights is not None:
            for (name, _), view in zip(named, views):
                view.copy_(self._lookup(name, view.shape))
        elif not self.meta:
            for view, value in zip(views, live):
                view.copy_(value)
        else:
            self._run_init(named, views)

    def _lookup(self, name: str, shape: torch.Size) -> torch.Tensor:
        if name not in self.weights:
            some = ", ".join(list(self.weights)[:3])
            raise KeyError(f"weights file {self.source} has no tensor '{name}' (it has {len(self.weights)}: {some}, ...)")
        t = self.weights[name]
        if t.shape != shape:
            raise ValueError(f"weights file {self.source}: '{name}' has shape {tuple(t.shape)}, the model expects {tuple(shape)}")
        return t

    def _run_init(self, named: list[tuple[str, nn.Parameter]], views: list[torch.Tensor]) -> None:
        """Point the parameters at the fp32 views and call init_fn on the modules whose own
        parameters (those they registered first) are all among them, then on the containers
        whose every parameter is."""
        params = {id(p) for _, p in named}
        for (_, p), view in zip(named, views):
            p.data = view
        with torch.no_grad():
            for module in self.modules:
                direct = [p for p in module._parameters.values() if p is not None]
                if all(id(p) in params for p in direct if self.first_owner[id(p)] is module):
                    borrowed = [p for p in direct if self.first_owner[id(p)] is not module]
                    self._init_keeping(module, borrowed, params)
            for module in self.containers:
                below = list(module.parameters())
                if id(module) not in self.initialized and all(id(p) in params for p in below):
                    inside = set(map(id, module.modules()))
                    self._init_keeping(module, [p for p in below if id(self.first_owner[id(p)]) not in inside], params)

    def _init_keeping(self, module: nn.Module, borrowed: list[nn.Parameter], filled: set[int]) -> None:
        """The module's reset_parameters, then init_fn(module), with the parameters it borrows from their first owner left as they
        are: a filled one keeps its values, a placeholder gets a scratch tensor of its shape
        for the call (an init reads shapes: fan-in) and is put back after."""
        kept = [(p, p.data.clone() if id(p) in filled else p.data) for p in borrowed]
        for p, _ in kept:
            if id(p) not in filled:
                p.data = torch.empty(self.shapes[id(p)], dtype=torch.float32)
        self.initialized.add(id(module))
        try:
            # As eager construction then model.apply(init_fn): the module's own initialization
            # first, so what init_fn leaves alone (a LayerNorm's weight) is not left at zero.
            default_init(module)
            if self.init_fn is not None:
                self.init_fn(module)
        finally:
            for p, old in kept:
                if id(p) in filled:
                    p.data.copy_(old)
                else:
                    p.data = old
