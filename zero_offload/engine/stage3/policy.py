"""Which parameters form which unit, and which modules must have which units gathered.

A unit is gathered around its root's forward, so a root must be a module whose forward runs.
Unit roots are the modules whose class is named in `stage3.unit_modules` (e.g. "Block"). With
none named, the model is split from the top down (`_default_roots`), each module placed as:

- not a root, its children placed instead: a module that never runs (a ModuleList or ModuleDict
  without a forward of its own; a ParameterList stays in its parent's unit), a wrapper (no
  parameters of its own and one child that runs holding them all: PEFT's PeftModel and
  LoraModel, whose forwards call past themselves into the model they wrap), and, outside the
  blocks, a repeated stack of blocks (a ModuleList or ModuleDict of one class, or an
  nn.Sequential of two or more) or a module holding one somewhere below, so that each block is a
  unit of its own, as low as the real compute (checkpoint_sequential calls a Sequential's items
  past its forward);
- a root whatever its size: a `stage3.leaf_modules` class, and inside a block a module that
  holds a list of modules of one class (experts: a router calls some of them, different ones on
  different ranks, so they are one unit at the layer that owns them and every rank gathers the
  same units at any D; an nn.Sequential always runs all of its items, so it is no such list);
- else a root when its parameters fit in `stage3.unit_bytes` or it has no parameterized child
  (a unit by itself), and split further otherwise.

The model itself is always a root: its leftover parameters form one more unit. With
unit_modules, leaf_modules still apply (a root strictly inside a leaf is dropped). Units may
nest; a parameter belongs to the innermost root above the first module that registers it, so a
tied parameter belongs to exactly one unit.

A frozen parameter that is not floating point (an integer permutation, a bool mask) belongs to
no unit (`kept_in_module`): it stays whole in its module, in its own dtype, as buffers do.

Users. Each root "uses" its unit: it is gathered around the root's forward. A module that
registers a parameter owned by a unit that does not enclose it (the tied LM head reading the
embedding's weight) also uses that unit, and so does a module registered twice, under two units
(one Linear shared by two blocks), for the units that own its parameters. `need_bytes` of a user
is what must be gathered at once while it runs: its units plus every enclosing unit; the live
budget must cover the largest.

TorchScript. A ScriptModule (`torch.jit.script(...)`) takes no Python hooks, and its forward, run
by the TorchScript interpreter, calls no hook of what it holds: it and everything inside it are
never roots, their parameters belong to the unit of the nearest eager module above, gathered
around that module's forward. The model itself scripted, or a scripted module that registers a
parameter of another unit (a user), is refused at initialize in one line naming it.

What no rule can see is checked when it happens: `RootCheck` stops the first forward (or the
first backward) at the first module that runs while its unit is not gathered (its root's forward
never ran, or a method other than that forward called it), in one line that names a fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zero_offload.config import ConfigError, Stage3Config


@dataclass
class UnitPlan:
    name: str  # the root module's path ("" is the model)
    module: nn.Module
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)


@dataclass
class Plan:
    units: list[UnitPlan]
    users: dict[nn.Module, tuple[int, ...]]  # module -> unit indices it acquires around forward
    chains: dict[nn.Module, tuple[int, ...]]  # user module -> every unit gathered while it runs
    # Units holding parameters of a list's items that a router may call on some ranks only: their
    # gradients are complete when their inputs' gradient is, not when every parameter reported.
    routed: set[int] = field(default_factory=set)
    # Unit index -> (path of the list whose item is the unit's root, class of the module that owns
    # it): two ranks about to gather two items of one list were routed apart (the refusal says so).
    siblings: dict[int, tuple[str, str]] = field(default_factory=dict)


def _bytes(module: nn.Module, elem: int) -> int:
    return sum(p.numel() for p in module.parameters()) * elem


_PARAM_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def _is_script(module: nn.Module) -> bool:
    """A TorchScript module: its forward runs in the interpreter, which calls no Python hook."""
    return isinstance(module, torch.jit.ScriptModule)


def _runs(module: nn.Module) -> bool:
    """Whether the class has a forward: a plain ModuleList or ModuleDict never runs (its owner
    calls its items); a subclass with a forward (a ModuleDict of experts that routes) does. (A
    ScriptModule's class attribute `forward` is a descriptor that fails when read from the class.)"""
    return _is_script(module) or type(module).forward is not nn.Module.forward


def kept_in_module(p: nn.Parameter) -> bool:
    """A frozen parameter of a dtype no compute-copy flat buffer holds (an integer permutation, a
    bool mask, a complex constant) stays whole in its module, in its own dtype, as a buffer does:
    cast to the compute dtype it would index or compare wrong, and it has no gradient to reduce."""
    return not p.requires_grad and not p.is_floating_point()


def scripted(model: nn.Module) -> set[int]:
    """ids of every ScriptModule and every module inside one: no hook can go on them."""
    return {id(d) for m in model.modules() if _is_script(m) for d in m.modules()}


def _holds_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _param_children(module: nn.Module) -> list[nn.Module]:
    return [c for c in module.children() if _holds_params(c)]


def _items(module: nn.Module, least: int) -> list[nn.Module] | None:
    """The parameterized items of a ModuleList or ModuleDict when there are at least `least`,
    all of one class; else None."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return None
    kids = _param_children(module)
    return kids if len(kids) >= least and len({type(k) for k in kids}) == 1 else None


def _is_stack(module: nn.Module) -> bool:
    """A repeated stack of blocks: its items are the units (one layer is a stack too)."""
    if isinstance(module, nn.Sequential):
        kids = _param_children(module)
        return len(kids) >= 2 and len({type(k) for k in kids}) == 1
    return _items(module, 1) is not None


def _is_routable(module: nn.Module) -> bool:
    """Two or more modules of one class in a list their owner indexes: maybe experts."""
    return _items(module, 2) is not None


def _is_wrapper(module: nn.Module) -> bool:
    """No parameters of its own and one child holding them all, a child that runs: it adds
    nothing a root needs, and its forward may call past itself into the child's children. (One
    whose only child is a container that never runs is what calls the container's items.)"""
    own = any(p is not None for p in module._parameters.values())
    kids = _param_children(module)
    return not own and len(kids) == 1 and _runs(kids[0])


def _owns_routable(module: nn.Module) -> bool:
    """Whether `module` is the nearest module that runs above a routable list."""
    return any(_is_routable(c) or (not _runs(c) and _owns_routable(c)) for c in module.children())


def _check_classes(model: nn.Module, field_name: str, names: tuple[str, ...]) -> None:
    classes = {type(m).__name__: m for m in model.modules()}
    for name in names:
        if name not in classes:
            raise ConfigError(f"config field 'stage3.{field_name}' names class '{name}', but the model has no "
                              f"module of that class (it has: {', '.join(sorted(classes))})")
        if not _runs(classes[name]):
            raise ConfigError(f"config field 'stage3.{field_name}' names class '{name}', a container whose "
                              "forward never runs (a unit is gathered around its root's forward): name the "
                              "class of the modules it holds")


def _roots(model: nn.Module, cfg: Stage3Config, elem: int) -> set[nn.Module]:
    _check_classes(model, "unit_modules", cfg.unit_modules)
    _check_classes(model, "leaf_modules", cfg.leaf_modules)
    leaves = {m for m in model.modules() if type(m).__name__ in cfg.leaf_modules}
    if cfg.unit_modules:
        roots = {m for m in model.modules() if type(m).__name__ in cfg.unit_modules} | {model}
    else:
        roots = _default_roots(model, cfg.unit_bytes, elem, leaves)
    inside = {id(d) for leaf in leaves for d in leaf.modules() if d is not leaf} | scripted(model)
    return {r for r in roots | leaves if id(r) not in inside or r is model}


def _default_roots(model: nn.Module, unit_bytes: int, elem: int, leaves: set[nn.Module]) -> set[nn.Module]:
    """See the module docstring: from the top down, each child placed by the first rule that applies."""
    roots = {model}
    stacks: dict[int, bool] = {}

    def holds_stack(m: nn.Module) -> bool:
        if id(m) not in stacks:
            stacks[id(m)] = any(_is_stack(c) or holds_stack(c) for c in m.children())
        return stacks[id(m)]

    def place(module: nn.Module, in_block: bool) -> None:
        in_block = in_block or _is_stack(module)  # the children of a stack are its blocks
        for child in module.children():
            if not _holds_params(child) or isinstance(child, _PARAM_CONTAINERS):
                continue  # a ParameterList is read by its parent's forward: it stays in that unit
            if child in leaves or (in_block and _runs(child) and _owns_routable(child)):
                roots.add(child)
            elif not _runs(child) or _is_wrapper(child) or (not in_block and (holds_stack(child) or _is_stack(child))):
                place(child, in_block)
            elif _bytes(child, elem) <= unit_bytes or not _param_children(child):
                roots.add(child)
            else:
                place(child, in_block)
    place(model, False)
    return roots


def _routed_and_siblings(model: nn.Module, units: list[UnitPlan],
                         leaf_classes: tuple[str, ...]) -> tuple[set[int], dict[int, tuple[str, str]]]:
    """Which units hold parameters of the items of a routable list inside a block or a leaf (see
    Plan.routed: the lists the default rule keeps whole), and which units are themselves items
    of a routable list anywhere (Plan.siblings), with the class of the nearest module above the
    list that runs (the one to name in stage3.leaf_modules)."""
    owner = {id(p): i for i, u in enumerate(units) for _, p in u.params}
    index = {id(u.module): i for i, u in enumerate(units)}
    routed: set[int] = set()
    siblings: dict[int, tuple[str, str]] = {}

    def walk(module: nn.Module, path: str, runner: str, nested: bool) -> None:
        nested_below = nested or _is_stack(module) or type(module).__name__ in leaf_classes
        for name, child in module.named_children():
            where = f"{path}.{name}" if path else name
            items = _items(child, 2)
            if items is not None and nested_below:
                routed.update(owner[id(p)] for item in items for p in item.parameters() if id(p) in owner)
            for item in items or ():
                if id(item) in index:
                    siblings[index[id(item)]] = (where, runner)
            walk(child, where, type(child).__name__ if _runs(child) else runner, nested_below)
    walk(model, "", type(model).__name__, False)
    return routed, siblings


def plan_units(model: nn.Module, cfg: Stage3Config, elem: int) -> Plan:
    """Group `model`'s parameters into units (elem = bytes per element of the compute copy)."""
    roots = _roots(model, cfg, elem)
    units: list[UnitPlan] = []
    unit_of: dict[nn.Module, int] = {}
    owner: dict[int, int] = {}  # id(param) -> unit index
    users: dict[nn.Module, set[int]] = {}
    chains: dict[nn.Module, tuple[int, ...]] = {}
    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str, chain: tuple[int, ...]) -> None:
        if id(module) in seen:
            _revisit(module, chain)
            return
        seen.add(id(module))
        if module in roots:
            unit_of[module] = len(units)
            units.append(UnitPlan(prefix.rstrip("."), module))
            chain = chain + (unit_of[module],)
            users.setdefault(module, set()).add(unit_of[module])
        for name, p in module._parameters.items():
            if p is None or kept_in_module(p):
                continue
            if id(p) not in owner:
                owner[id(p)] = chain[-1]
                units[chain[-1]].params.append((prefix + name, p))
            elif owner[id(p)] not in chain:
                users.setdefault(module, set()).add(owner[id(p)])
        if module in users:
            chains[module] = tuple(sorted(set(chain) | users[module]))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", chain)

    def _revisit(module: nn.Module, chain: tuple[int, ...]) -> None:
        """A module registered a second time, under another unit (one Linear shared by two
        blocks): when called from there it uses the units that own its parameters."""
        foreign = {owner[id(p)] for p in module.parameters() if id(p) in owner and owner[id(p)] not in chain}
        if foreign:
            users.setdefault(module, set()).update(foreign)
            chains[module] = tuple(sorted(set(chains.get(module, ())) | set(chain) | users[module]))

    _refuse_script(model)
    walk(model, "", ())
    _refuse_script_users(model, users)
    plan = _drop_empty(units, {m: tuple(sorted(s)) for m, s in users.items()}, chains)
    plan.routed, plan.siblings = _routed_and_siblings(model, plan.units, cfg.leaf_modules)
    return plan


def _refuse_script(model: nn.Module) -> None:
    """Stage 3 starts each pass in the model's forward pre-hook, which a ScriptModule cannot take."""
    if _is_script(model):
        raise ConfigError(f"stage 3 cannot train a model that is itself a TorchScript module ({type(model).__name__}): "
                          "its forward takes no hooks; wrap it in an eager nn.Module, or use stages 0-2")


def _refuse_script_users(model: nn.Module, users: dict[nn.Module, set[int]]) -> None:
    """A scripted module that reads another unit's parameter (a tied weight) would need a hook
    around its own forward to gather that unit."""
    inside = scripted(model)
    for name, m in model.named_modules(remove_duplicate=False):
        if id(m) in inside and m in users:
            raise ConfigError(f"stage 3: TorchScript module '{name}' ({type(m).__name__}) holds a parameter shared "
                              "with another unit (a tied weight), which it cannot gather (a ScriptModule takes no "
                              "hooks): untie it, script only modules that own their parameters, or use stages 0-2")


def _drop_empty(units: list[UnitPlan], users: dict[nn.Module, tuple[int, ...]],
                chains: dict[nn.Module, tuple[int, ...]]) -> Plan:
    """Renumber without parameterless roots (a container root whose children took everything)."""
    keep = [i for i, u in enumerate(units) if u.params]
    new = {old: i for i, old in enumerate(keep)}

    def remap(idx: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(new[i] for i in idx if i in new)
    users2 = {m: remap(ix) for m, ix in users.items() if remap(ix)}
    chains2 = {m: remap(chains[m]) for m in users2}
    return Plan([units[i] for i in keep], users2, chains2)


# adopt(module name, module, unit indices, args, kwargs, why, hint): the module acquires those units
# around its calls from now on, this call included; returns the call's new (args, kwargs) or None,
# or raises `why` (the whole refusal) when the module cannot; `hint` names the units that would
# gather less often (see Stage3Runtime.adopt).
Adopt = Callable[[str, nn.Module, list[int], tuple, dict, str, str], "tuple | None"]


class RootCheck:
    """The first forward and the first backward, watched: a module that runs while a unit holding
    its own parameters is not gathered would find them empty (torch would fail inside the op, e.g.
    "'weight' must be 2-D"). In forward, that unit's root never ran its forward: a module above it
    called into it directly, past the root (a root calling a child's method, checkpoint_sequential
    calling a stack's items). In backward, a method other than the root's forward called it (a
    reversible layer's own backward, as Reformer's, runs its sub-modules again). The module is
    handed to `adopt`, which makes it a user of those units from now on (with the line that names
    the units that would work, for the cases it cannot). Removed once a backward completes."""

    def __init__(self, model: nn.Module, plan: Plan, gathered: Callable[[int], bool], named: bool,
                 in_backward: Callable[[], bool] = lambda: False, adopt: Adopt | None = None) -> None:
        self.plan, self.gathered, self.named = plan, gathered, named  # named: by stage3.unit_modules
        self.in_backward, self.adopt = in_backward, adopt
        owner = {id(p): i for i, u in enumerate(plan.units) for _, p in u.params}
        self.ran: set[int] = set()
        self.handles: list[RemovableHandle] = []
        inside = scripted(model)
        for name, m in model.named_modules():
            if id(m) in inside:
                continue  # no hook on a ScriptModule; its unit is its eager parent's, checked there
            units = sorted({owner[id(p)] for p in m._parameters.values() if p is not None and id(p) in owner})
            self.handles.append(m.register_forward_pre_hook(self._pre_hook(name, units), with_kwargs=True))

    def _pre_hook(self, name: str, units: list[int]) -> Callable[..., tuple | None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            self.ran.add(id(module))
            missing = [i for i in units if not self.gathered(i)]
            if not missing:
                return None
            unit = self.plan.units[missing[0]]
            what, hint = (self._in_backward if self.in_backward() else self._message)(name, module, unit)
            why = f"{what}; {hint}"
            if self.adopt is None:
                raise RuntimeError(why)
            return self.adopt(name, module, missing, args, kwargs, why, hint)
        return hook

    def _message(self, name: str, module: nn.Module, unit: UnitPlan) -> tuple[str, str]:
        """What happened in forward, and the units that would work."""
        root = unit.name or "the model"
        below = name[len(unit.name) + 1:] if unit.name else name
        path, ran = unit.module, None
        for part in below.split("."):  # the highest module between the root and `module` that ran
            path = getattr(path, part)
            if id(path) in self.ran:
                ran = path
                break
        return (f"stage 3: '{name}' ({type(module).__name__}) ran while its unit '{unit.name or '<root>'}' was "
                f"not gathered: the forward of the unit's root module '{root}' ({type(unit.module).__name__}) never "
                "ran (a module above it calls into it directly)",
                f"make units of modules that run, e.g. stage3.unit_modules=['{type(ran or module).__name__}']"
                + (" (or none, for zero_offload's choice)" if self.named else ""))

    def _in_backward(self, name: str, module: nn.Module, unit: UnitPlan) -> tuple[str, str]:
        """What happened in backward, and the units that would work."""
        kids = [type(c).__name__ for c in unit.module.children() if _holds_params(c)] or [type(module).__name__]
        return (f"stage 3: '{name}' ({type(module).__name__}) ran in backward while its unit "
                f"'{unit.name or '<root>'}' was not gathered: a method of '{unit.name or 'the model'}' "
                f"({type(unit.module).__name__}) other than its forward calls it there (a reversible layer's own "
                "backward does)",
                f"make units of the modules that method calls, e.g. stage3.unit_modules={list(dict.fromkeys(kids))}")

    def backward_done(self) -> None:
        """A backward completed: every way into the units has been seen once."""
        self.remove()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
