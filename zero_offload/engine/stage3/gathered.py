"""Whole parameters outside forward at stage 3: the body of `engine.gathered(...)`.

Between passes a stage-3 parameter is an empty tensor (its unit is sharded), so reading a
weight, printing its norm or calling `module.state_dict()` there would see nothing. Inside
`engine.gathered(params)` the units holding `params` are gathered (every rank, a collective) and
the parameters are whole compute copies; with `modify=True` the values rank 0 holds at the end
of the block are broadcast and become every rank's shards: the compute copy, and for trainable
parameters the fp32 master shard (the moments are kept, as a torch optimizer keeps its state when
a weight is edited in place). In bf16/fp16 the master takes the compute copy's values.

The units come and go outside any pass: the traced schedule is not told, the live budget is.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Protocol

import torch
from torch import nn

from zero_offload import comm
from zero_offload.engine.stage3.prefetch import Prefetcher
from zero_offload.engine.stage3.unit import Unit, UnitState
from zero_offload.engine.step.shard_optimizer import ShardOptimizer


class Gathers(Protocol):
    """What engine.gathered needs of the stage-3 runtime (Stage3Runtime provides it): its units,
    the prefetcher whose budget counts them, the shard optimizer whose masters a modify writes,
    and the pair that refuses a gathered block inside a pass or another block."""

    units: list[Unit]
    prefetcher: Prefetcher
    shard_optimizer: ShardOptimizer
    rank: int

    def begin_gathered(self) -> None: ...

    def end_gathered(self) -> None: ...


def wanted_params(what: nn.Module | nn.Parameter | Iterable[nn.Module | nn.Parameter] | None,
                  model: nn.Module) -> list[nn.Parameter]:
    """The parameters named by `what`: modules (all their parameters), parameters, a mix of
    both, or None for the whole model."""
    if what is None:
        return list(model.parameters())
    items = [what] if isinstance(what, (nn.Module, torch.Tensor)) else list(what)
    out: list[nn.Parameter] = []
    for item in items:
        if isinstance(item, nn.Module):
            out.extend(item.parameters())
        elif isinstance(item, torch.Tensor):
            out.append(item)
        else:
            raise TypeError(f"engine.gathered: expected modules or parameters, got {type(item).__name__}")
    return out


def units_of(rt: Gathers, params: list[nn.Parameter]) -> list[Unit]:
    """The units holding `params`, in unit order; a tensor that is no parameter of the engine's
    model is refused (it would silently stay as it is)."""
    home = {id(p): u for u in rt.units for p in u.params()}
    missing = [i for i, p in enumerate(params) if id(p) not in home]
    if missing:
        raise ValueError(f"engine.gathered: tensor {missing[0]} of the {len(params)} parameters named is not a "
                         "parameter of the engine's model")
    wanted = {home[id(p)].index for p in params}
    return [u for u in rt.units if u.index in wanted]


@contextlib.contextmanager
def gathered(rt: Gathers, params: list[nn.Parameter], modify: bool) -> Iterator[None]:
    """Gather the units holding `params` for the block; see the module docstring."""
    rt.begin_gathered()  # refused inside a pass, or inside another block (its release_all would take these)
    try:
        units = units_of(rt, params)
        _check_fits(rt, units)
        rt.prefetcher.release_all()  # read-aheads: their bytes back, and no fetch runs beside the writes below
    except BaseException:
        rt.end_gathered()
        raise
    taken: list[Unit] = []
    try:
        for u in units:
            if not u.resident:
                taken.append(u)  # first: a Ctrl-C right after the gather still lets it go below
                rt.prefetcher.gather_apart(u)
        yield
        if modify:
            for u in units:
                _write_back(rt, u)
        else:
            _refuse_edits(units)
    finally:
        rt.end_gathered()
        for u in taken:
            if u.state is UnitState.GATHERED:
                u.keep_aliases()  # a weight the block handed out outlives it (Unit.keep_aliases)
            rt.prefetcher.let_go_apart(u)


def _check_fits(rt: Gathers, units: list[Unit]) -> None:
    need = sum(u.nbytes for u in units if not u.resident)
    limit = rt.prefetcher.budget.limit
    if need > limit:
        raise RuntimeError(f"engine.gathered: the units {[u.name for u in units if not u.resident]} need {need} "
                           f"bytes gathered at once, above stage3.live_budget_bytes = {limit}; gather fewer "
                           "parameters or modules at a time")


def _refuse_edits(units: list[Unit]) -> None:
    """A parameter written in place inside a block with modify=False: the write would be
    dropped at release without a word (a forward inside the block keeps its own writes already,
    as a pass does). Refused; the shards stay as they were."""
    for u in units:
        for g in u.groups:
            names = u.edited_names(g)
            if names:
                raise RuntimeError(f"engine.gathered: parameter '{names[0]}' (unit '{u.name}') was changed in place "
                                   "inside a block with modify=False, and the change is dropped; pass modify=True "
                                   "to keep it")


def _write_back(rt: Gathers, u: Unit) -> None:
    """Rank 0's values of every group of `u` become every rank's shards (a resident unit, which
    stays gathered, has every rank's slot from the broadcast already)."""
    for g in u.groups:
        u.take_replaced(g)
        comm.broadcast_(g.flat, 0)
        lo, hi = g.layout.shard_range(rt.rank)
        shard = g.flat[lo:hi].clone()
        if g.trainable:
            rt.shard_optimizer.take_edit(g.key, shard)
        u.write_shard(g.key, shard)
        u.settle_write(g.key)
