"""Buffers of a model built on the meta device: what an eager build would hold, or an error.

A buffer has no value on the meta device, and many are computed by their module's constructor and
kept out of weight files (RoPE's `inv_freq` is non-persistent). Each buffer gets, in this order:
- a persistent buffer that the weights hold: the weights' value;
- else, a meta buffer: its value from the module's own constructor, run again on the CPU with the
  arguments its signature names read from the module's attributes of the same name (a rotary
  embedding keeps `self.config`, a BatchNorm its `num_features`, `eps`, ...), or else from the
  nearest enclosing module's (BERT's embeddings are given the model's `config` without keeping it). The rebuilt module
  must have the same submodules, parameter and buffer names and shapes, buffer dtypes and plain
  attributes, or it is not used. Rebuilding allocates the module's own parameters once, so it is
  done only for modules of at most REBUILD_MAX_NUMEL elements (small ones: the rotary embedding
  owns no parameter at all); the RNG is left as it was;
- else a placeholder, which the init (a module's reset_parameters, the model's `_init_weights`,
  then init_fn) must write. A module under a transformers-style model (one with `_init_weights`:
  materialize.model_inits) is never rebuilt: transformers computes such buffers in `_init_weights`
  (Gemma 3's embed_scale, Swin v2's relative_coords_table, Falcon-H1's mup_vector, whose
  constructors take arguments the modules do not keep), and its own loader does the same.
Inits run after this, so what they write wins, as after eager construction. At `finish` a
placeholder nothing wrote is a one-line error naming the buffer, its module and the fix: never
zeros, never meta. Every buffer then moves to the compute device (floating ones in the compute
dtype, as `model.to(device, dtype)` would).
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import torch
from torch import nn

REBUILD_MAX_NUMEL = 1 << 26  # parameters + buffers a rebuilt module may allocate (256 MiB in fp32)
FACTORY_ARGS = ("device", "dtype")  # torch's factory kwargs: taken at their defaults when not kept
PLAIN = (bool, int, float, str, type(None))


class MetaBuffers:
    """Gives every buffer of `model` its value at construction (see the module docstring)."""

    def __init__(self, model: nn.Module, weights: Mapping[str, torch.Tensor] | None, source: str,
                 shapes: Mapping[int, torch.Size], governed: Mapping[int, str] | None = None) -> None:
        """`shapes`: id(parameter) -> shape, for parameters already replaced by empty placeholders;
        `governed`: id(module) -> the class name of the model whose `_init_weights` initializes it."""
        self.model, self.weights, self.source, self.shapes = model, weights, source, shapes
        self.governed = dict(governed or {})
        self._placeholders: list[tuple[str, nn.Module, str, torch.Tensor, int, str]] = []
        self._rebuilt: dict[int, tuple[nn.Module | None, str]] = {}  # id(module) -> rebuild(module)
        pending: dict[int, list[tuple[str, nn.Module, str]]] = {}  # id(meta buffer) -> its registrations
        loaded: dict[int, torch.Tensor] = {}  # id(buffer) -> the weights' value for it
        by_name = dict(model.named_modules())
        self._enclosing = {id(m): _enclosing(name, by_name) for name, m in by_name.items()}
        for mname, module in model.named_modules():
            for bname, b in module._buffers.items():
                full = f"{mname}.{bname}" if mname else bname
                if b is None:
                    continue
                if id(b) in loaded:  # a buffer registered twice: the first name the weights hold decides
                    module._buffers[bname] = loaded[id(b)]
                elif id(b) not in pending and self._from_weights(full, module, bname, b):
                    loaded[id(b)] = module._buffers[bname]
                elif b.is_meta:
                    pending.setdefault(id(b), []).append((full, module, bname))
        for registrations in pending.values():
            self._fill(registrations)

    def _from_weights(self, full: str, module: nn.Module, bname: str, b: torch.Tensor) -> bool:
        """A persistent buffer the weights hold takes their value (a non-persistent one is not
        loaded from a file by load_state_dict either: its constructor's value stands)."""
        if self.weights is None or bname in module._non_persistent_buffers_set or full not in self.weights:
            return False
        value = self.weights[full]
        if value.shape != b.shape:
            raise ValueError(f"weights file {self.source}: buffer '{full}' has shape {tuple(value.shape)}, the model "
                             f"expects {tuple(b.shape)}")
        module._buffers[bname] = value.to(device="cpu", dtype=b.dtype, copy=True)
        return True

    def _fill(self, registrations: list[tuple[str, nn.Module, str]]) -> None:
        """One meta buffer, under each (full name, module, own name) it is registered as: from the
        first of its modules that can be rebuilt, else one placeholder with the first's reason."""
        reasons = []
        for _, module, bname in registrations:
            if id(module) in self.governed:
                reasons.append(f"{self.governed[id(module)]}._init_weights does not set it")
                continue
            if id(module) not in self._rebuilt:
                self._rebuilt[id(module)] = rebuild(module, self.shapes, self._enclosing.get(id(module), ()))
            built, why = self._rebuilt[id(module)]
            if built is not None:
                value = built._buffers[bname].detach()
                for _, m, n in registrations:
                    m._buffers[n] = value
                return
            reasons.append(why)
        old = registrations[0][1]._buffers[registrations[0][2]]
        placeholder = torch.empty(old.shape, dtype=old.dtype)
        for full, module, bname in registrations:
            module._buffers[bname] = placeholder
            self._placeholders.append((full, module, bname, placeholder, placeholder._version, reasons[0]))

    def placeholder_modules(self) -> set[int]:
        """id of every module holding a buffer that an init must write."""
        return {id(module) for _, module, *_ in self._placeholders}

    def finish(self, device: torch.device, initialized: set[int], dtype: torch.dtype) -> None:
        """Refuse a placeholder no init wrote (neither replaced nor written in place), then move
        every buffer to `device`, floating ones in the compute `dtype` as `model.to(device, dtype)`
        does at stages 0-2 (a BatchNorm's running statistics must match its bf16 input), once per
        tensor: shared buffers stay shared. `initialized`: the id of every module the init was
        called on (what the error may suggest)."""
        for full, module, bname, placeholder, version, why in self._placeholders:
            if module._buffers.get(bname) is placeholder and placeholder._version == version:
                raise ValueError(self._unwritten(full, module, why, id(module) in initialized))
        moved: dict[int, torch.Tensor] = {}
        for module in self.model.modules():
            for bname, b in module._buffers.items():
                if b is not None:
                    if id(b) not in moved:
                        moved[id(b)] = b.to(device, dtype) if b.is_floating_point() else b.to(device)
                    module._buffers[bname] = moved[id(b)]

    def _unwritten(self, full: str, module: nn.Module, why: str, init_called: bool) -> str:
        if init_called:
            fix = "set it in init_fn (which is called on that module), or "
        elif self.weights is not None:
            fix = "put it in the weights file, or "
        else:
            fix = ""  # no init reaches it (no init runs, or its parameters span several units)
        where = "it is not in the weights, and " if self.weights is not None else ""
        how = why if id(module) in self.governed else f"its module cannot be rebuilt on the CPU to compute it ({why})"
        return (f"initialize: buffer '{full}' ({type(module).__name__}) of the meta-device model has no value: "
                f"{where}{how}; {fix}build that module off the meta device")


def _enclosing(name: str, by_name: Mapping[str, nn.Module]) -> tuple[nn.Module, ...]:
    """The modules enclosing the one at `name`, nearest first (the model last)."""
    parts = name.split(".") if name else []
    return tuple(by_name[".".join(parts[:i])] for i in range(len(parts) - 1, -1, -1))


def rebuild(module: nn.Module, shapes: Mapping[int, torch.Size],
            enclosing: Sequence[nn.Module] = ()) -> tuple[nn.Module | None, str]:
    """`module` built again on the CPU by its own constructor, from its attributes (or those of
    the nearest enclosing module that has one of that name: a Hugging Face block is given the
    model's `config` but need not keep it); or None and why not (a one-line reason)."""
    numel = _numel(module, shapes)
    if numel > REBUILD_MAX_NUMEL:
        return None, f"it would allocate {numel} elements, over the {REBUILD_MAX_NUMEL} allowed"
    args = _constructor_args(module, enclosing)
    if isinstance(args, str):
        return None, args
    try:
        with torch.device("cpu"), torch.random.fork_rng(devices=[]):
            built = type(module)(*args[0], **args[1])
    except Exception as exc:
        return None, f"its constructor raised {type(exc).__name__}: {' '.join(str(exc).split())}"
    differs = _difference(module, built, shapes)
    return (None, differs) if differs else (built, "")


def _numel(module: nn.Module, shapes: Mapping[int, torch.Size]) -> int:
    params = {id(p): shapes.get(id(p), p.shape).numel() for p in module.parameters()}
    buffers = {id(b): b.numel() for b in module.buffers()}
    return sum(params.values()) + sum(buffers.values())


def _constructor_args(module: nn.Module, enclosing: Sequence[nn.Module] = ()) -> tuple[list[Any], dict[str, Any]] | str:
    """(positional, keyword) arguments for type(module)(...), each read from the module's
    attribute of its name, else the nearest enclosing module's; a reason string when one cannot
    be. What is built this way is used only if it matches the module (_difference)."""
    try:
        params = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return "its constructor's signature cannot be read"
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        owner = next((vars(m) for m in (module, *enclosing) if p.name in vars(m)), None)
        if owner is not None:
            value = owner[p.name]
            if isinstance(value, (nn.Module, torch.Tensor)):
                return f"its constructor's argument '{p.name}' is a module or tensor"
        elif p.name in FACTORY_ARGS and p.default is not p.empty:
            value = p.default
        else:
            return f"its constructor's argument '{p.name}' is not an attribute of the module or of one enclosing it"
        if p.kind is p.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[p.name] = value
    return args, kwargs


def _difference(module: nn.Module, built: nn.Module, shapes: Mapping[int, torch.Size]) -> str:
    """How the rebuilt module differs from the original (its buffers would not be the same
    thing), or '' when its structure, shapes, buffer dtypes and plain attributes agree."""
    mine, theirs = _layout(module, shapes), _layout(built, {})
    if mine != theirs:
        name = sorted(set(mine.items()) ^ set(theirs.items()), key=str)[0][0]
        return f"the module its constructor builds from those attributes differs in '{name}'"
    built_modules = dict(built.named_modules())
    for name, sub in module.named_modules():
        other = vars(built_modules[name])
        for key, value in vars(sub).items():
            if key != "training" and not key.startswith("_") and key in other and _plain(value) \
                    and _plain(other[key]) and value != other[key]:
                where = f"{name}.{key}" if name else key
                return f"built again its attribute '{where}' is {other[key]!r}, not {value!r}"
    if any(b.is_meta for b in built.buffers()):
        return "its constructor makes its buffers on the meta device"
    return ""


def _layout(module: nn.Module, shapes: Mapping[int, torch.Size]) -> dict[str, tuple]:
    """Every submodule, parameter (name, shape) and buffer (name, shape, dtype) of `module`."""
    out: dict[str, tuple] = {f"module {n}": () for n, _ in module.named_modules()}
    out.update({f"parameter {n}": tuple(shapes.get(id(p), p.shape)) for n, p in module.named_parameters()})
    out.update({f"buffer {n}": (tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()})
    return out


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, PLAIN) for v in value)
    return isinstance(value, PLAIN)
