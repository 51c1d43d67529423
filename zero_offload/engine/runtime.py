"""The seam between the facade and the runtimes: the `Runtime` protocol and the records that cross it.

Everything that differs between ZeRO stages sits behind a runtime (`BucketRuntime` in
engine/buckets/runtime.py for stages 0-2, `Stage3Runtime` in engine/stage3/runtime.py for stage 3).
The facade (engine.py, memory.py) and the state code (state/checkpoint.py, state/export.py) see a
runtime only through `Runtime`, and the Engine's own state only through `TrainingState` and
`ModelView`, so none of them imports the Engine or a runtime class, and none asks which stage runs.
The memory report's shared row helpers live here too: each runtime names its bytes in them, and
memory.py assembles the report above both. So does what both runtimes do alike: `RuntimeBase`
(the members that concern only the shard optimizer and the accumulator), `consolidate` (the
whole model's state_dict from `flat_sources`), `pieces_of` and `close_in_order`.

A seam module: it imports only torch, the standard library, what lies below the engine and
engine/step, and the runtimes and the modules above them import it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from zero_offload import comm
from zero_offload.engine.step.accumulate import Accumulator
from zero_offload.engine.step.shard_optimizer import ShardOptimizer

if TYPE_CHECKING:
    from zero_offload.partition import FlatLayout

Pieces = dict[str, list[tuple[str, int, int, int]]]  # shard key -> (param name, param offset, shard offset, numel)

FROZEN_ROW = "frozen parameters (not in the ledger)"  # whole at stages 0-2, this rank's shards at stage 3


@dataclass(frozen=True)
class TrainingState:
    """The Engine's step counters, as a checkpoint saves them and a load gives them back."""

    global_steps: int
    micro_step: int


@dataclass(frozen=True)
class ModelView:
    """What the state code reads of the Engine beside its runtime: the model, its compute device
    and the dtypes the model's state_dict had before the engine cast it."""

    module: nn.Module
    device: torch.device
    orig_dtypes: Mapping[str, torch.dtype]


@dataclass(frozen=True)
class FlatSource:
    """A flat buffer whose parameters' values are read at once (a stage 0-2 bucket, a stage-3
    unit's trainable or frozen group); `read` gives this rank's shard in `dtype`."""

    layout: "FlatLayout"
    params: list[nn.Parameter]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Standing:
    """How the optimizer shards stand after a step or a backward failed: what the facade needs
    to decide whether the engine stops, read once from the runtime."""

    failed_hand_over: str | None  # the first shard whose hand-over failed or was interrupted
    steps_apart: str | None  # after a failed step: how its shards stand apart (agreed by every rank)
    mixed_steps: str | None  # this rank's shards at more than one step (ShardOptimizer.mixed_steps)
    counts: tuple[list[tuple[str, int]], list[tuple[str, int]]]  # sorted shard and sub-shard step counts


def standing_of(so: ShardOptimizer) -> Standing:
    """The Standing of a runtime's shard optimizer (both runtimes report it alike)."""
    return Standing(so.failed_hand_over, so.steps_apart, so.mixed_steps(),
                    (sorted(so.steps.items()), sorted(so.sub_steps.items())))


@runtime_checkable
class Runtime(Protocol):
    """What the facade, the memory report and the state code call on a runtime."""

    replicated: bool  # stage 0: every rank holds (and steps) every shard
    shard_optimizer: ShardOptimizer
    accumulator: Accumulator

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """param_groups for schedulers."""

    # ---- the training call order (engine.py) ----
    def refuse_compiled(self, module: nn.Module) -> None:
        """Refuse a forward under torch.compile where the runtime cannot run one."""

    def begin_forward(self, boundary: bool) -> None:
        """A forward with grad enabled starts (`boundary`: its backward ends a cycle)."""

    def begin_backward(self, boundary: bool) -> None:
        """Checks before anything is reduced (parameters replaced, frozen or edited)."""

    def end_backward(self) -> None:
        """Reduce what got no gradient; the grad shards are with the step."""

    def backward_touched(self) -> bool:
        """After a failed backward: whether anything had been reduced."""

    def abort_backward(self) -> None:
        """After a failed backward: nothing more is reduced; handed shards are finished."""

    def step(self) -> bool:
        """Finish the optimizer step and bring the compute copy up to date; False if skipped."""

    def standing(self) -> Standing:
        """How the shards stand (after a failed step or backward)."""

    def gathers_updates(self) -> bool:
        """Whether updated shards reach the compute copy only by all-gathers at the end of a
        whole step (stages 1-2 with D > 1), which an interrupted step skips."""

    def gathered(self, params: list[nn.Parameter], modify: bool) -> ContextManager[None]:
        """The body of engine.gathered: `params` whole for the block; with `modify`, rank 0's
        values become every rank's (and the optimizer's master)."""

    # ---- checkpoints and exports (state/) ----
    def shard_map(self) -> Pieces:
        """This rank's shards: which element ranges of which parameters each holds."""

    def frozen_map(self) -> Pieces:
        """The same for frozen groups kept in the runtime's shards (stage 3; {} otherwise)."""

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Trainable parameters' shapes by name."""

    def frozen_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the frozen parameters in frozen_map."""

    def read_frozen(self, key: str) -> torch.Tensor:
        """This rank's shard of a frozen group of frozen_map."""

    def write_frozen(self, key: str, values: torch.Tensor) -> None:
        """Replace this rank's shard of a frozen group of frozen_map (a checkpoint load)."""

    def refresh_params(self) -> None:
        """Rebuild the compute copy from the master shards (after a load)."""

    def shards_frozen(self) -> bool:
        """Whether frozen parameters live in the runtime's shards (stage 3), not in the module."""

    def held_params(self) -> set[int]:
        """ids of the module's parameters whose values live in the runtime's shards, not the
        module (empty tensors between passes at stage 3); none at stages 0-2."""

    def flat_sources(self) -> list[FlatSource]:
        """Every flat buffer in a fixed order (the same on every rank), for streamed exports."""

    def consolidated(self, orig_dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """The model's state_dict on rank 0 (fp32 trainable values, the rest in the model's own
        dtypes), {} elsewhere; a collective."""

    # ---- the memory report (memory.py) ----
    def trainable_numel(self) -> int:
        """P, the number of trainable elements (the ledger's)."""

    def retained(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(bytes held now, high-water mark) by (state group, tier)."""

    def extras(self) -> dict[str, float]:
        """Bytes outside the ledger's groups, by the name of their row."""

    def limits(self) -> dict[str, int]:
        """Configured bounds shown apart in the report."""

    def close(self) -> None:
        """Stop the runtime's threads and remove its files."""


class RuntimeBase:
    """The Runtime members both runtimes have alike, as they concern only the shard optimizer
    and the gradient accumulator (each runtime sets both in its own __init__); a mixin, not a
    Runtime: the Protocol stays the one description of a runtime."""

    shard_optimizer: ShardOptimizer
    accumulator: Accumulator

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.shard_optimizer.optimizer

    def begin_forward(self, boundary: bool) -> None:
        """Called by the Engine before a training forward: on the boundary the optimizer may start
        reading its first shards' state now, under the forward."""
        if boundary:
            self.shard_optimizer.prefetch()

    def standing(self) -> Standing:
        return standing_of(self.shard_optimizer)

    def state_retained(self) -> dict[tuple[str, str], tuple[int, int]]:
        """retained()'s rows for the optimizer state and the gradients (the weights are each
        runtime's own)."""
        so = self.shard_optimizer
        return {("optimizer", so.store.tier): (so.store.bytes_retained(), so.store.peak_bytes()),
                **grads_by_tier([so.grad_store, self.accumulator.store])}

    def state_extras(self, layouts: dict[str, "FlatLayout"]) -> dict[str, float]:
        """extras()'s rows for the optimizer state and the gradients held, over the trainable flat
        buffers' `layouts` by key (padding, NVMe slot rounding, the staging ring)."""
        so, acc = self.shard_optimizer, self.accumulator
        held, summed = so.held_grads(), acc.held()
        grad_bytes = so.grad_store.bytes_retained() + acc.store.bytes_retained()
        return {"padding (optimizer state)": padding({k: so.spec.state_bytes(g.shard_numel) for k, g in layouts.items()},
                                                     layouts),
                "padding (gradients held)": padding(held, layouts) + padding(summed, layouts),
                "NVMe slot rounding (gradients)": grads_slot_rounding(
                    grad_bytes, sum(held.values()) + sum(summed.values()), so.grad_store.addressable),
                "NVMe slot rounding (optimizer state)": so.slot_rounding_bytes(),
                "staging buffers": so.bytes_retained().get("staging", 0),
                "speculative step snapshots": so.snapshot_bytes}


def pieces_of(names: Sequence[str], layout: "FlatLayout", rank: int) -> list[tuple[str, int, int, int]]:
    """A flat buffer's entry of shard_map (or frozen_map): rank `rank`'s shard, piece by piece."""
    return [(names[pc.index], pc.param_offset, pc.shard_offset, pc.numel) for pc in layout.pieces(rank)]


def consolidate(module: nn.Module, sources: Sequence[FlatSource], device: torch.device, *,
                keep: bool, orig_dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """The model's state_dict with whole values, on the host (a collective: every rank calls it).
    Each source's parameters come whole in fp32 from its shards (all-gathered when sharded), the
    rest (buffers, parameters outside the runtime's flat buffers) from the module. With
    `orig_dtypes`, all but the trainable parameters take the model's own dtypes. A rank that
    does not `keep` the result takes part in the all-gathers only and gets {}."""
    whole = _whole_values(sources, device, keep)
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for k, v in module.state_dict(keep_vars=True).items():
        value = whole.get(id(v))
        if value is not None and (orig_dtypes is None or v.requires_grad):
            out[k] = value  # fp32, a copy of ours (tied keys share it, as module.state_dict's do)
            continue
        src = v.detach() if value is None else value
        moved = src.to("cpu", src.dtype if orig_dtypes is None else orig_dtypes.get(k, src.dtype))
        out[k] = moved.clone() if value is None else moved  # never the module's own tensor
    return out


def _whole_values(sources: Sequence[FlatSource], device: torch.device, keep: bool) -> dict[int, torch.Tensor]:
    """id(parameter) -> its whole fp32 value on the host, from each source's shards in turn."""
    whole: dict[int, torch.Tensor] = {}
    for s in sources:
        if s.layout.world == 1 and not keep:
            continue  # the shard is the whole buffer (stage 0, or D = 1): no collective to take part in
        full = s.read().float()
        if s.layout.world > 1:
            full, shard = torch.empty(s.layout.padded_numel, dtype=torch.float32, device=device), full
            comm.all_gather_(full, shard.to(device))
        full = full.cpu()
        for p, view in zip(s.params, s.layout.views(full)):
            whole[id(p)] = view.clone()
    return whole


def close_in_order(steps: Sequence[Callable[[], None]], stores: Sequence[Any]) -> None:
    """A runtime's close: `steps` in order (threads stop, writes end), then every store of
    `stores` that was made (None: construction failed before it), even when a step raised: the
    files go even when a last write failed."""
    try:
        for step in steps:
            step()
    finally:
        for store in stores:
            if store is not None:
                store.close()


# ---- the memory report's rows the runtimes fill (memory.py assembles the report) ----

def padding(held: dict[str, int], layouts: dict[str, "FlatLayout"]) -> float:
    """Bytes of padding in held tensors (key -> bytes), each a shard or the whole flat buffer of
    its key's layout: either way padded in the proportion padded_numel : numel. Against the
    ledger's even split of P, a shard's padding is its share of the layout's (the last rank's
    shard holding all of it changes no rank's size)."""
    return sum(n * (layouts[k].padded_numel - layouts[k].numel) / layouts[k].padded_numel
               for k, n in held.items() if k in layouts)


def grads_slot_rounding(stores_bytes: int, held_bytes: int, addressable: bool) -> int:
    """Bytes the grads tier's stores hold beyond the gradients in them: NVMe slots are whole
    pages (a resident tier holds exactly the tensors)."""
    return 0 if addressable else stores_bytes - held_bytes


def grads_by_tier(stores: list[Any]) -> dict[tuple[str, str], tuple[int, int]]:
    """(held, peak) of the gradient stores under each one's own tier: with CUDA, a host
    optimizer keeps the grad shards it waits for in host memory whatever tiers.grads says."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for s in stores:
        held, peak = out.get(("gradients", s.tier), (0, 0))
        out[("gradients", s.tier)] = (held + s.bytes_retained(), peak + s.peak_bytes())
    return out
