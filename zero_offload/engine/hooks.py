"""Module and autograd hooks that tell the stage-3 runtime when a unit is needed and when it is done.

Forward: a pre-hook on each module that uses units (a unit's root module, or a module that reads a
tied parameter owned by another unit) acquires them; a post-hook releases them.
Backward, "needed": the post-hook registers a pre-hook on the autograd node of every output
tensor (a hook on the tensor for a leaf); it fires when the gradient of that output is computed,
i.e. before the module's backward runs, after the tensor hooks that let the next module's units
go (the output is often that module's input), and the runtime
gathers the units again (idempotently: several outputs, a module called twice, activation
checkpointing's recomputation all reach it more than once).
Backward, "done": a post-accumulate-grad hook on every trainable parameter fires once per backward
(autograd sums every use of a parameter first), so a unit whose trainable parameters have all
reported has its gradients. A unit with frozen parameters needs its weights until the gradient of
its inputs has been computed (a frozen weight may still be needed for it after every trainable
parameter reported); a multi-grad hook on its inputs reports that.

Nothing is stored on the modules or parameters: the runtime keeps its own tables, and the handles
returned here remove every hook.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zero_offload.engine.unit import Unit


class HookTarget(Protocol):
    def forward_enter(self, module: nn.Module, units: Sequence[Unit], watch: RemovableHandle | None) -> None: ...
    def forward_exit(self, module: nn.Module, units: Sequence[Unit]) -> None: ...
    def backward_enter(self, units: Sequence[Unit]) -> None: ...
    def inputs_grad(self, units: Sequence[Unit]) -> None: ...
    def param_grad(self, unit: Unit, param: torch.Tensor) -> None: ...
    def wants_inputs_grad(self, units: Sequence[Unit]) -> bool: ...


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (a module's output or
    arguments). A unit whose output tensors are not found here is not gathered again for its
    backward, which then fails on the empty parameters."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def _watch_inputs(args: tuple, kwargs: dict, done: Callable[[], None]) -> RemovableHandle | None:
    """Call `done` once the gradients of every grad-requiring tensor among the arguments
    (positional or keyword, nested too: Hugging Face layers take `hidden_states=`) have been
    computed; its handle (None when there is none), which the runtime removes at the next pass: a
    leaf input (a parameter passed in) would keep the hook, and call `done` again in every later
    backward. A hook on the tensors themselves, not an identity Function around them: the module
    may modify its input in place, which autograd refuses on a custom Function's output view."""
    seen: dict[int, torch.Tensor] = {}
    for t in _tensors((args, kwargs)):
        if t.requires_grad:
            seen.setdefault(id(t), t)
    if not seen:
        return None
    return torch.autograd.graph.register_multi_grad_hook(list(seen.values()), lambda grads: done(), mode="all")


def install_module_hooks(users: dict[nn.Module, tuple[Unit, ...]], target: HookTarget) -> list[RemovableHandle]:
    """Forward pre/post hooks and output-gradient hooks on every module that uses units."""
    handles: list[RemovableHandle] = []
    for module, units in users.items():
        handles.append(module.register_forward_pre_hook(_pre_hook(units, target), with_kwargs=True))
        handles.append(module.register_forward_hook(_post_hook(units, target)))
    return handles


def _pre_hook(units: tuple[Unit, ...], target: HookTarget) -> Callable[[nn.Module, tuple, dict], None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        watch = None
        if torch.is_grad_enabled() and target.wants_inputs_grad(units):
            watch = _watch_inputs(args, kwargs, lambda: target.inputs_grad(units))
        target.forward_enter(module, units, watch)
    return hook


def _post_hook(units: tuple[Unit, ...], target: HookTarget) -> Callable[[nn.Module, tuple, Any], None]:
    def on_output_grad(*_: Any) -> None:
        target.backward_enter(units)

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled():
            nodes: set[int] = set()
            for t in _tensors(output):
                if not t.requires_grad:
                    continue
                if t.grad_fn is None:
                    t.register_hook(on_output_grad)
                elif id(t.grad_fn) not in nodes:
                    # A pre-hook of the node, not a hook of the tensor: the tensor may also be the
                    # next module's input, whose gradient hook lets that module's units go, and a
                    # node's pre-hooks run after its tensors' hooks, so units are let go first.
                    nodes.add(id(t.grad_fn))
                    t.grad_fn.register_prehook(on_output_grad)
        target.forward_exit(module, units)
    return hook


def install_param_hooks(units: Sequence[Unit], target: HookTarget) -> list[RemovableHandle]:
    """One post-accumulate-grad hook per trainable parameter, reporting to its unit."""
    handles: list[RemovableHandle] = []
    for unit in units:
        group = unit.trainable
        for p in group.params if group is not None else []:
            handles.append(p.register_post_accumulate_grad_hook(_grad_hook(unit, target)))
    return handles


def _grad_hook(unit: Unit, target: HookTarget) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        target.param_grad(unit, p)
    return hook
