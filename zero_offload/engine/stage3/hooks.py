"""Module and autograd hooks that tell the stage-3 runtime when a unit is needed and when it is done.

Forward: a pre-hook on each module that uses units (a unit's root module, a module that registers
a tied parameter owned by another unit, or one found reading another unit's parameter: ReadWatch)
acquires them; a post-hook releases them. The hooks ask the runtime for a module's units at each
call (`units_of`), since a recording pass may add some.
Backward, "needed": the post-hook registers a pre-hook on the autograd node of every output
tensor that this call computed (a hook on the tensor for a leaf); it fires when the gradient of
that output is computed, i.e. before the module's backward runs, after the tensor hooks that let
the next module's units go (the output is often that module's input), and the runtime
gathers the units again (idempotently: several outputs, a module called twice, activation
checkpointing's recomputation all reach it more than once). An output passed through (an input,
or a view of one, returned as it came: T5's position bias, made by the first block and returned
by every later one) is skipped: its node is an earlier module's, whose gradient comes only after
this module's backward, and it needs none of this module's weights. So is a parameter returned
(a module handing its weight to its caller): whoever reads it gathers its unit.
An output whose gradient can no longer reach the unit's trainable parameters once they have
all reported (a root returning what an inner unit computed: CLIP's pooled outputs beside its
loss) asks for nothing: see `reaches`.
Backward, "done": a post-accumulate-grad hook on every trainable parameter fires once per backward
(autograd sums every use of a parameter first), so a unit whose trainable parameters have all
reported has its gradients. A unit with frozen parameters needs its weights until the gradient of
its inputs has been computed (a frozen weight may still be needed for it after every trainable
parameter reported); an InputWatch on this call's inputs reports that.

Nothing is stored on the modules or parameters: the runtime keeps one record per unit for the
pass (unit.UnitPass), and the handles returned here remove every hook.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from zero_offload.engine.stage3.unit import Unit


class HookTarget(Protocol):
    def units_of(self, module: nn.Module) -> tuple[Unit, ...]: ...
    def forward_enter(self, module: nn.Module, units: Sequence[Unit], watch: "InputWatch | None") -> None: ...
    def forward_exit(self, module: nn.Module, units: Sequence[Unit]) -> tuple[Unit, ...]: ...
    def backward_enter(self, module: nn.Module, units: Sequence[Unit], node: Any) -> None: ...
    def inputs_grad(self, units: Sequence[Unit]) -> None: ...
    def param_grad(self, unit: Unit, param: torch.Tensor) -> None: ...
    def wants_inputs_grad(self, units: Sequence[Unit]) -> bool: ...


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (a module's output or
    arguments). A unit whose output tensors are not found here is not gathered again for its
    backward, which then fails on the empty parameters."""
    out: list[torch.Tensor] = []
    _collect(obj, out)
    return out


_SCALARS = (bool, int, float, str, type(None))


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    """_tensors' walk; it runs at every hooked call, twice, so the common kinds come first."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _collect(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _collect(o, out)
    elif not isinstance(obj, _SCALARS) and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), out)


class InputWatch:
    """Calls `done` once the gradient of this call's inputs is complete: a multi-grad hook on
    per-call aliases of the grad-requiring input tensors (positional or keyword, nested too:
    Hugging Face layers take `hidden_states=`). An alias (`t.view_as(t)`) is consumed by this
    call only, so its gradient is complete right after the module's backward, even when the
    tensor itself feeds other units too (an encoder output to every cross-attention, a parameter
    passed in); and, unlike a custom Function's output, a plain view may be modified in place.
    If the module did modify one, its hook no longer says when this call's backward is over, so
    a second hook, on the tensors themselves as they were before the call (later than needed
    when they feed others too, never too early), is kept instead; `settle` keeps one of the two.
    The runtime removes the hook at the next pass (`remove`): on a leaf it would stay, and call
    `done` again in every later backward."""

    def __init__(self, aliases: list[tuple[torch.Tensor, torch.Tensor, int]], done: Callable[[], None]) -> None:
        self.aliases, self.done = aliases, done
        self.handle = self._hook([a for a, _, _ in aliases])
        self.fallback: RemovableHandle | None = self._hook(list({id(t): t for _, t, _ in aliases}.values()))

    def _hook(self, tensors: list[torch.Tensor]) -> RemovableHandle:
        return torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: self.done(), mode="all")

    def settle(self) -> None:
        """After the module's forward: the aliases' hook, unless one was modified in place."""
        if self.fallback is None:
            raise RuntimeError("stage 3: an input watch settled twice (internal error)")
        if any(a._version != v for a, _, v in self.aliases):
            self.handle.remove()
            self.handle = self.fallback
        else:
            self.fallback.remove()
        self.fallback, self.aliases = None, []

    def remove(self) -> None:
        self.handle.remove()
        if self.fallback is not None:  # its forward raised before settle
            self.fallback.remove()


def _alias(obj: Any, out: list[tuple[torch.Tensor, torch.Tensor, int]]) -> Any:
    """`obj` with every grad-requiring tensor in it (through tuples, lists and dicts) replaced by
    a view of itself, each recorded in `out` with its version."""
    if isinstance(obj, torch.Tensor):
        if not obj.requires_grad:
            return obj
        alias = obj.view_as(obj)
        out.append((alias, obj, alias._version))
        return alias
    if type(obj) in (tuple, list):
        return type(obj)(_alias(o, out) for o in obj)
    if type(obj) is dict:
        return {k: _alias(v, out) for k, v in obj.items()}
    return obj


def install_module_hooks(modules: Iterable[nn.Module], target: HookTarget) -> list[RemovableHandle]:
    """Forward pre/post hooks and output-gradient hooks on every module that uses units."""
    handles: list[RemovableHandle] = []
    for module in modules:
        handles += _install(module, target)[0]
    return handles


def _install(module: nn.Module, target: HookTarget) -> tuple[list[RemovableHandle], Callable[..., tuple | None]]:
    open_calls: list[_Call] = []  # one per call in progress (a module may re-enter)
    pre = _pre_hook(target, open_calls)
    return [module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(_post_hook(target, open_calls))], pre


def hook_module_now(module: nn.Module, target: HookTarget, args: tuple,
                    kwargs: dict) -> tuple[list[RemovableHandle], tuple | None]:
    """install_module_hooks for a module whose call has begun (its pre-hooks are running): torch
    took the list of pre-hooks before this one existed, so it runs here for this call (its
    result is the call's new (args, kwargs), or None); the post-hook torch runs after forward."""
    handles, pre = _install(module, target)
    return handles, pre(module, args, kwargs)


@dataclasses.dataclass
class _Call:
    """One call in progress: the units its pre-hook acquired, its input watch, and the autograd
    node each grad-requiring input's root tensor had at entry (see _passed_through)."""

    units: tuple[Unit, ...]
    watch: "InputWatch | None"
    inputs: dict[int, Any]


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns `t`'s memory and history: its base when `t` is a view."""
    return t._base if t._is_view() else t


def _input_nodes(args: tuple, kwargs: dict) -> dict[int, Any]:
    nodes = {}
    for t in _tensors((args, kwargs)):
        if t.requires_grad:
            root = t._base if t._is_view() else t  # _root, inlined: this runs at every hooked call
            nodes[id(root)] = root.grad_fn
    return nodes


def _passed_through(t: torch.Tensor, inputs: dict[int, Any]) -> bool:
    """`t` is an input of the call, or a view of one, unchanged since the call began (an input
    modified in place has a new node and carries this call's work)."""
    root = _root(t)
    return id(root) in inputs and inputs[id(root)] is root.grad_fn


def _pre_hook(target: HookTarget, open_calls: list[_Call]) -> Callable[[nn.Module, tuple, dict], tuple | None]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        units = target.units_of(module)
        watch, aliases = None, []
        if torch.is_grad_enabled() and target.wants_inputs_grad(units):
            args, kwargs = _alias(args, aliases), _alias(kwargs, aliases)
            watch = InputWatch(aliases, lambda: target.inputs_grad(units)) if aliases else None
        open_calls.append(_Call(units, watch, _input_nodes(args, kwargs) if torch.is_grad_enabled() else {}))
        target.forward_enter(module, units, watch)
        return (args, kwargs) if watch is not None else None
    return hook


def _post_hook(target: HookTarget, open_calls: list[_Call]) -> Callable[[nn.Module, tuple, Any], None]:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        call = open_calls.pop() if open_calls else _Call((), None, {})
        if call.watch is not None:
            call.watch.settle()
        used = target.forward_exit(module, call.units)  # with any unit found read during the call
        if torch.is_grad_enabled():
            _hook_outputs(output, call.inputs, lambda node: target.backward_enter(module, used, node))
    return hook


def _hook_outputs(output: Any, inputs: dict[int, Any], on_output_grad: Callable[[Any], None]) -> None:
    """`on_output_grad(node)` before the backward of each output this call computed (`node` the
    output's autograd node, None for a leaf)."""
    nodes: set[int] = set()
    for t in _tensors(output):
        if not t.requires_grad or _passed_through(t, inputs):
            continue
        if t.grad_fn is None:
            if not isinstance(t, nn.Parameter):  # a parameter returned: its readers gather its unit
                t.register_hook(lambda grad: on_output_grad(None))
            continue
        # Pre-hooks of the node, not a hook of the tensor: the tensor is often the next
        # module's input, whose watch lets that module's units go, and a node's pre-hooks
        # run after its tensors' hooks, so units are let go first. A view's base's node
        # too: the caller may modify the view in place, which replaces the view's node.
        base = t._base if t._is_view() else None
        for node in (t.grad_fn, base.grad_fn if base is not None else None):
            if node is not None and id(node) not in nodes:
                nodes.add(id(node))
                node.register_prehook(lambda grads, node=node: on_output_grad(node))


# How many autograd nodes `reaches` walks before it answers yes, to stay cheap on any graph.
REACH_LIMIT = 100_000


def reaches(node: Any, params: Sequence[torch.Tensor]) -> bool:
    """Whether a gradient flowing into `node` can still reach one of `params`: a path of
    next_functions to the AccumulateGrad node of one (None, a leaf's node, reaches only itself).
    Yes when unsure (more than REACH_LIMIT nodes), so a caller that refuses on yes errs safe."""
    wanted = {id(p) for p in params}
    seen: set[int] = set()
    stack = [node] if node is not None else []
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > REACH_LIMIT:
            return True
        variable = getattr(n, "variable", None)  # AccumulateGrad: a leaf's gradient sink
        if variable is not None and id(variable) in wanted:
            return True
        stack.extend(next_node for next_node, _ in n.next_functions)
    return False


# Reads of a tensor's metadata only: right while its unit is sharded (dtype, device: Hugging
# Face's `model.dtype` asks every parameter `is_floating_point()`), or not a read at all (the
# engine's own `p.data = view`). A shape is not among them: it is (0,) then.
_METADATA = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in (
        "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "_base", "_version", "grad", "layout", "itemsize",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn")]
    + [getattr(torch.Tensor, name) for name in (
        "is_floating_point", "is_complex", "is_signed", "element_size", "get_device", "is_inference", "_is_view",
        "__hash__")]
    + [torch.Tensor.data.__set__, torch.Tensor.grad.__set__])


class ReadWatch(TorchFunctionMode):
    """Active while a recording pass's forward runs: each torch call's tensor arguments (nested
    one level, as in torch.cat's list) are looked up among the parameters in `owned` (by id; a
    view's base too), and `found(param)` is called before the call runs, so the runtime can gather
    a unit whose parameter is read outside the forward of the module that registers it (a head
    written as `F.linear(x, self.wte.weight)`). About as costly as the call itself, so it runs
    only in recording passes; later passes gather what it found with the module that read it."""

    def __init__(self, owned: dict[int, Any], found: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.owned, self.found = owned, found

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func not in _METADATA:
            self._scan(args)
            if kwargs:
                self._scan(kwargs.values())
        return func(*args, **(kwargs or {}))

    def _scan(self, values: Iterable[Any]) -> None:
        for a in values:
            if isinstance(a, torch.Tensor):
                self._check(a)
            elif type(a) in (list, tuple):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        self._check(b)

    def _check(self, t: torch.Tensor) -> None:
        if id(t) in self.owned:
            self.found(t)
            return
        base = t._base
        if base is not None and id(base) in self.owned:
            self.found(base)


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
