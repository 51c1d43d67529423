"""The tier registry: what each tier (device, cpu, nvme) is, in one record, so that no other module
tests a tier's name.

A tier name ('device', 'cpu', 'nvme') is what `Config.tiers.<group>` holds and what the ledger and
the memory report use as a column; everything the code asks of a tier (is it the compute device's
memory, is it addressable, does it need `nvme_paths`, is it shared by a machine's ranks, what
DeepSpeed calls it) is a field here. Pure data that imports nothing of ours, so config.py checks
its combinations against it; the store class of each tier is chosen one layer up, in
`store.make_store` (a record naming a class above config would be an import from a higher layer).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    """One tier. `name` is the value of `Config.tiers.<group>` and the ledger's and memory report's
    column for it."""

    name: str
    on_device: bool  # the compute device's own memory: a device optimizer steps it there (torch's fused Adam)
    resident: bool  # addressable memory (a store's view is the tensor itself); else files read through staging
    needs_nvme_paths: bool  # its store opens files under Config.nvme_paths
    machine_shared: bool  # one pool for all the ranks of a machine (host RAM, the drive): the ledger's machine totals
    deepspeed: str  # DeepSpeed's `offload_*.device` value for this tier

    @property
    def off_device(self) -> bool:
        """Anywhere but the compute device: the state the engine moves out of device memory."""
        return not self.on_device


DEVICE = Tier("device", on_device=True, resident=True, needs_nvme_paths=False, machine_shared=False, deepspeed="none")
CPU = Tier("cpu", on_device=False, resident=True, needs_nvme_paths=False, machine_shared=True, deepspeed="cpu")
NVME = Tier("nvme", on_device=False, resident=False, needs_nvme_paths=True, machine_shared=True, deepspeed="nvme")
REGISTRY = (DEVICE, CPU, NVME)  # in column order: the ledger's, the memory report's and `estimate`'s
TIERS = tuple(t.name for t in REGISTRY)  # the choices of Config.tiers.*, of `--*-tier` and of the ledger
_BY_NAME = {t.name: t for t in REGISTRY}
_BY_DEEPSPEED = {t.deepspeed: t for t in REGISTRY}


def spelled(names: tuple[str, ...] | list[str]) -> str:
    """'a, b or c': how an error lists the choices."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else "".join(names)


def tier(name: str) -> Tier:
    """The record of tier `name`; a name that is none is a ValueError listing the tiers."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown tier {name!r}: expected {spelled(TIERS)}")
    return found


def known(name: object) -> bool:
    """Whether `name` is a tier's name."""
    return isinstance(name, str) and name in _BY_NAME


def from_deepspeed(device: object) -> Tier | None:
    """The tier a DeepSpeed `offload_*.device` value stands for ('none' is the device), or None."""
    return _BY_DEEPSPEED.get(device) if isinstance(device, str) else None
