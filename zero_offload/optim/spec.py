"""What an optimizer is to the rest of zero_offload: its state parts, its hyperparameters, its kernels.

An `OptimizerSpec` is the one place the engine, the ledger, the staging ring, the memory report,
the checkpoint and the benchmarks learn how many bytes of state an optimizer keeps per element
and what its parts are called. Adding an optimizer is one spec module (its parts, its
hyperparameter dataclass with one `check`, its kernels) registered in optim/registry.py, plus its kernel.

This module and the spec modules import no torch: config.py validates hyperparameters through
them, and `import zero_offload` stays cheap. Kernels are named by import path and loaded when
first used.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, NoReturn

FP32_BYTES = 4

# fail(name, value, allowed): raise the caller's own one-line error for a bad hyperparameter.
Fail = Callable[[str, Any, str], NoReturn]


@dataclass(frozen=True)
class StatePart:
    """One array of optimizer state, one element per parameter element (e.g. AdamW's m)."""

    name: str
    bytes_per_element: int = FP32_BYTES


@dataclass(frozen=True)
class Bound:
    """The range a hyperparameter must lie in (finite always); its wording is config's, for every
    caller, so one range reads the same wherever it is refused."""

    low: float
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def holds(self, value: float) -> bool:
        if not math.isfinite(value) or value < self.low or (self.open_low and value == self.low):
            return False
        return self.high is None or value < self.high or (value == self.high and not self.open_high)

    def wording(self) -> str:
        top = "inf)" if self.high is None else f"{float(self.high)}{')' if self.open_high else ']'}"
        return f"expected a finite number in {'(' if self.open_low else '['}{float(self.low)}, {top}"


def as_float(name: str, value: Any) -> float:
    """The lenient reading of a number (a kernel's or a torch-style optimizer's: a 0-dim tensor
    lr is a number too)."""
    return float(value)


def check_number(name: str, value: Any, bound: Bound, fail: Fail,
                 number: Callable[[str, Any], float] = as_float) -> None:
    """`value` read by `number`, refused through `fail` unless `bound` holds it."""
    if not bound.holds(number(name, value)):
        fail(name, value, bound.wording())


def check_betas(value: Any, bound: Bound, fail: Fail, number: Callable[[str, Any], float] = as_float) -> None:
    """A (beta1, beta2) pair, each inside `bound`: the moment coefficients Adam-like optimizers share."""
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        fail("betas", value, "expected two numbers [beta1, beta2]")
    for i, beta in enumerate(value):
        check_number(f"betas[{i}]", beta, bound, fail, number)


@dataclass(frozen=True)
class Kernels:
    """An optimizer's step per kind of device where its state lives, as "module:attribute" paths:
    `host` steps state in host memory (the cpu and nvme tiers), `device` on the accelerator (the
    device tier). Each names a class whose instances step one shard (see optim/adamw_kernels.py)."""

    host: str
    device: str

    def load(self, device: bool) -> type:
        module, _, attr = (self.device if device else self.host).partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer as the engine sees it. Every part is kept as fp32 words back to back in one
    store key and one staging-ring region per shard (master first), in the order of `parts`."""

    name: str
    parts: tuple[StatePart, ...]
    hyperparams: type  # a dataclass of the group's hyperparameters with check(fail, *, bounds, number)
    kernels: Kernels
    # A training configuration's ranges, where they are stricter than what the kernels take
    # (None: the hyperparameters' own defaults).
    config_bounds: Mapping[str, Bound] | None = field(default=None, compare=False)
    label: str = ""  # how messages name it ("Adam"); its name when empty

    @property
    def title(self) -> str:
        return self.label or self.name

    def __post_init__(self) -> None:
        if not self.parts or self.parts[0].name != "master":
            raise ValueError(f"optimizer spec {self.name!r}: its first state part must be the fp32 'master'")
        odd = [p.name for p in self.parts if p.bytes_per_element != FP32_BYTES]
        if odd:  # the store and the ring lay out state as fp32 words; a narrower part needs that changed first
            raise ValueError(f"optimizer spec {self.name!r}: parts {odd} are not {FP32_BYTES}-byte (fp32); "
                             "shard state is laid out as fp32 words")

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    @property
    def bytes_per_element(self) -> int:
        """Bytes of state per parameter element (the ledger's optimizer bytes per parameter)."""
        return sum(p.bytes_per_element for p in self.parts)

    def state_bytes(self, numel: int) -> int:
        """Bytes of state a shard of `numel` elements keeps."""
        return self.bytes_per_element * numel

    def state_numel(self, numel: int) -> int:
        """fp32 words of a shard's state: what its store key and ring region hold."""
        return len(self.parts) * numel

    def check(self, values: Mapping[str, Any], fail: Fail, *, number: Callable[[str, Any], float] = as_float,
              config: bool = False) -> None:
        """Refuse, through `fail`, the first bad hyperparameter of `values` (e.g. config.optimizer's
        fields): those the spec's hyperparams name are taken, the rest (an eps Lion has not) are
        not its concern. `config`: with config_bounds."""
        names = [f.name for f in fields(self.hyperparams)]
        bounds = {"bounds": self.config_bounds} if config and self.config_bounds is not None else {}
        self.hyperparams(**{n: values[n] for n in names if n in values}).check(fail, number=number, **bounds)

    def kernel(self, device: bool) -> type:
        """The class that steps a shard on the device (True) or in host memory (False)."""
        return self.kernels.load(device)

