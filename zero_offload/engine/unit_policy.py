"""Which parameters form which unit, and which modules must have which units gathered.

Unit roots are the modules whose class is named in `stage3.unit_modules` (e.g. "Block"); with none
named, the largest subtrees whose parameters fit in `stage3.unit_bytes` (a module larger than
that with no parameterized children is a unit by itself; a ModuleList or ModuleDict, never
called itself, is never a root: its items are considered instead). The model itself is always a root: its
leftover parameters (embeddings, final norm...) form one more unit. Units may nest; a parameter
belongs to the innermost root above the first module that registers it, so a tied parameter
belongs to exactly one unit.

Users. Each root "uses" its unit: it is gathered around the root's forward. A module that
registers a parameter owned by a unit that does not enclose it (the tied LM head reading the
embedding's weight) also uses that unit, and so does a module registered twice, under two units
(one Linear shared by two blocks), for the units that own its parameters. `need_bytes` of a user
is what must be gathered at once while it runs: its units plus every enclosing unit; the live
budget must cover the largest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

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


def _bytes(module: nn.Module, elem: int) -> int:
    return sum(p.numel() for p in module.parameters()) * elem


# A unit is gathered around its root's forward, so a root must be a module that is called.
# These containers never are: a model iterates a ModuleList and calls its items, and reads a
# ParameterList's tensors in its own forward.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_PARAM_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def _roots(model: nn.Module, cfg: Stage3Config, elem: int) -> set[nn.Module]:
    if cfg.unit_modules:
        classes = {type(m).__name__ for m in model.modules()}
        for name in cfg.unit_modules:
            if name not in classes:
                raise ConfigError(f"config field 'stage3.unit_modules' names class '{name}', but the model has no "
                                  f"module of that class (it has: {', '.join(sorted(classes))})")
            if name in {c.__name__ for c in _CONTAINERS + _PARAM_CONTAINERS}:
                raise ConfigError(f"config field 'stage3.unit_modules' names class '{name}', a container whose "
                                  "forward never runs (a unit is gathered around its root's forward): name the "
                                  "class of the modules it holds")
        return {m for m in model.modules() if type(m).__name__ in cfg.unit_modules} | {model}
    roots = {model}

    def split(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, _CONTAINERS):  # never called: its children are what runs
                split(child)
                continue
            if isinstance(child, _PARAM_CONTAINERS):  # read by the parent's forward: stays in its unit
                continue
            has_sub = any(True for c in child.children() if any(True for _ in c.parameters()))
            if _bytes(child, elem) <= cfg.unit_bytes or not has_sub:
                if any(True for _ in child.parameters()):
                    roots.add(child)
            else:
                split(child)
    split(model)
    return roots


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
            if p is None:
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

    walk(model, "", ())
    return _drop_empty(units, {m: tuple(sorted(s)) for m, s in users.items()}, chains)


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
