"""What a load will write, worked out and checked before anything is read into the engine: the
saved pieces that fill each of this engine's shards (any world size or bucketing), the
module-held tensors, the lagging step counts, and that the model is the one that was saved."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zero_offload.engine.runtime import Runtime
from zero_offload.engine.state import manifest_checks
from zero_offload.engine.state.common import non_trainable
from zero_offload.engine.state.files import CheckpointError

Copies = dict[str, list[tuple[str, int, int, int]]]  # shard key -> (file, source offset, shard offset, numel)


def plan(maps: dict[int, dict[str, Any]], which: str, current: dict[str, list[tuple[str, int, int, int]]]) -> Copies:
    """For each of this engine's shard keys, the (file, source offset, shard offset, numel) copies
    that fill it, checked to cover every element of every piece before anything is read."""
    index: dict[str, list[tuple[str, int, int, int]]] = {}  # param name -> saved (file, param off, shard off, n)
    for r, m in maps.items():
        for key, pieces in m.get(which, {}).items():
            for name, poff, soff, n in pieces:
                index.setdefault(name, []).append((f"rank{r}.{key}.pt", poff, soff, n))
    out: Copies = {}
    for key, pieces in current.items():
        copies = out.setdefault(key, [])
        for name, poff, soff, n in pieces:
            covered = 0
            for fname, opoff, osoff, on in index.get(name, []):
                lo, hi = max(poff, opoff), min(poff + n, opoff + on)
                if lo < hi:
                    copies.append((fname, osoff + lo - opoff, soff + lo - poff, hi - lo))
                    covered += hi - lo
            if covered != n:
                raise CheckpointError(f"checkpoint holds {covered} of {n} elements of {name!r} ({which})")
    return out


def lagging(root: str, maps: dict[int, dict[str, Any]]) -> dict[str, list[list[int]]]:
    """Every writer's lagging step counts, by parameter (see checkpoint.py's docstring), checked."""
    out: dict[str, list[list[int]]] = {}
    for r, m in maps.items():
        saved = m.get("lagging", {})
        if not manifest_checks.lagging_table(saved):
            raise CheckpointError(f"checkpoint {root}: rank{r}.json: lagging is {str(saved)[:40]!r}, expected "
                                  "parameter names to lists of [offset, numel, step count]")
        for name, runs in saved.items():
            out.setdefault(name, []).extend(runs)
    return out


def check_shapes(root: str, what: str, current: dict[str, Any], saved: dict[str, Any]) -> None:
    """The model's parameters (trainable or frozen) have the saved names and shapes."""
    now = {k: tuple(v) for k, v in current.items()}
    then = {k: tuple(v) for k, v in saved.items()}
    if now != then:
        diff = sorted(set(now.items()) ^ set(then.items()))[:3]
        raise CheckpointError(f"checkpoint {root} does not match the model's {what}: {diff}")


def check_frozen_home(rt: Runtime, module: nn.Module, stage: int, root: str, saved_stage: int) -> None:
    """Stages 0-2 keep frozen parameters in the module (model.pt), stage 3 shards them inside
    their units (frozen_map): a checkpoint crosses between the two only without any. `stage` is
    this engine's, for the message; the runtime says where its frozen parameters live."""
    if (saved_stage == 3) == rt.shards_frozen():
        return
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if frozen:
        raise CheckpointError(f"checkpoint {root} was saved at stage {saved_stage}, which keeps frozen parameters "
                              f"{'sharded in their units' if saved_stage == 3 else 'in model.pt'}; loading it at stage "
                              f"{stage} with frozen parameters ({frozen[:3]}) is not supported: load it "
                              f"at stage {'3' if saved_stage == 3 else '0, 1 or 2'}")


def checked_non_trainable(rt: Runtime, module: nn.Module, saved: dict[str, torch.Tensor], root: str,
                          resized: frozenset[str] = frozenset()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(module tensor, saved value) for every buffer and module-held frozen parameter, after
    checking that model.pt holds exactly these names with the same shapes, and the same dtype
    (a floating-point one may come from another float precision). Names in `resized` may differ
    in shape: their module's own loader resizes them (load.py checked that it does)."""
    current = non_trainable(rt, module)
    if set(saved) != set(current):
        diff = sorted(set(saved) ^ set(current))[:3]
        raise CheckpointError(f"checkpoint {root}: model.pt's buffers and frozen parameters differ from the model's: {diff}")
    pairs = []
    for k, t in current.items():
        v = saved[k]
        same_kind = v.dtype == t.dtype or (v.dtype.is_floating_point and t.dtype.is_floating_point)
        if (v.shape != t.shape and k not in resized) or not same_kind:
            raise CheckpointError(f"checkpoint {root}: model.pt's {k!r} is {v.dtype} {tuple(v.shape)}, "
                                  f"the model's is {t.dtype} {tuple(t.shape)}")
        pairs.append((t, v))
    return pairs
