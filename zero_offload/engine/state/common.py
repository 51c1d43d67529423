"""What a save and a load both use: the ranks' agreement on an outcome, and the tensors the
module itself holds (buffers and frozen parameters outside stage-3 units)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero_offload import comm
from zero_offload.engine.runtime import Runtime
from zero_offload.engine.state.files import CheckpointError


def attempt(fn: Any, *args: Any) -> Exception | None:
    """fn(*args)'s error, if any (to be agreed on by every rank), else None."""
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def agree(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank has an error: its own, or the first other rank's."""
    errors = comm.gather_objects(None if error is None else str(error))
    if error is not None:
        raise error
    for r, message in enumerate(errors):
        if message is not None:
            raise CheckpointError(f"rank {r} {what}: {message}")


def non_trainable(rt: Runtime, module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters that live in the module itself.

    At stage 3 frozen parameters inside units are sharded and released between uses (their tensor
    is empty here); they are saved shard by shard instead (the runtime's frozen_map).
    """
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    in_units = rt.held_params()
    return {k: v for k, v in module.state_dict(keep_vars=True).items()
            if id(v) not in trainable and id(v) not in in_units}
