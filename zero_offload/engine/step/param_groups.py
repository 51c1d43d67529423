"""Parameter groups: per-parameter optimizer hyperparameters, as torch optimizers take them.

`initialize(model, config, param_groups=[{"params": [...], "weight_decay": 0.0}, ...])` follows
torch's convention (the usual recipe: no weight decay on biases and norms). A group overrides any
of lr, betas, eps and weight_decay of `config.optimizer`; `engine.optimizer.param_groups` then
has one dict per group, in the order given, for LR schedulers to drive.

The groups never reach the flat shards' layout. A shard (a bucket's or a unit's) may hold pieces
of parameters from several groups, so the optimizer keeps, per shard, the runs of elements that
share a group -- `(start offset, group index)`, from the shard map's pieces -- and steps each run
with its own group's scalars (one kernel call per run; a shard of one group is one call, as
before). Padding at a shard's end takes the group of the run before it: its gradient is zero
and so are its master and moments, so any group's update leaves it zero.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from zero_offload.config import ConfigError, OptimizerConfig

OVERRIDES = ("lr", "betas", "eps", "weight_decay")  # what a group may set; anything else is refused
LABELS = ("name",)  # kept in the group, not used


def resolve(model: torch.nn.Module, groups: Any, defaults: OptimizerConfig) -> tuple[list[dict], dict[str, int]]:
    """([each group's hyperparameters], {trainable parameter name: group index}) from the user's
    `param_groups`; every trainable parameter must be in exactly one group. Runs before the
    engine touches the model (stage 3 replaces the parameter objects as it materializes them)."""
    if not isinstance(groups, (list, tuple)) or not groups:
        raise ConfigError(f"param_groups: expected a non-empty list of dicts, got {type(groups).__name__}")
    by_id, by_name = _model_params(model)
    hyper, group_of = [], {}
    for i, group in enumerate(groups):
        hyper.append(_hyper(i, group, defaults))
        for name in _names(i, group["params"], by_id, by_name):
            if group_of.get(name, i) != i:  # twice in one group is harmless (a tied alias, say)
                raise ConfigError(f"param_groups[{i}]: parameter {name!r} is already in param_groups[{group_of[name]}]")
            group_of[name] = i
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n in trainable if n not in group_of]
    if missing:
        raise ConfigError(f"param_groups: {len(missing)} trainable parameter(s) are in no group, e.g. "
                          f"{missing[:3]}; every trainable parameter needs a group (add a group for the rest)")
    return hyper, {n: group_of[n] for n in trainable}


def _model_params(model: torch.nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """{id(parameter): its name} and {every name, tied aliases too: the name named_parameters uses}."""
    by_id: dict[int, str] = {}
    for name, p in model.named_parameters():
        by_id[id(p)] = name
    by_name = {name: by_id[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
    return by_id, by_name


def _hyper(i: int, group: Any, defaults: OptimizerConfig) -> dict:
    """Group i's lr, betas, eps and weight_decay (the config's where it says nothing), checked
    as the config checks them."""
    if not isinstance(group, dict) or "params" not in group:
        raise ConfigError(f"param_groups[{i}]: expected a dict with a 'params' entry, got {group!r:.80}")
    unknown = sorted(set(group) - {"params", *OVERRIDES, *LABELS})
    if unknown:
        raise ConfigError(f"param_groups[{i}]: unknown key(s) {unknown}; a group may set {list(OVERRIDES)}")
    overrides = {k: group[k] for k in OVERRIDES if k in group}
    try:
        checked = OptimizerConfig(**{**{k: getattr(defaults, k) for k in ("name", "threads")},
                                     **{k: getattr(defaults, k) for k in OVERRIDES}, **overrides})
    except ConfigError as exc:
        raise ConfigError(f"param_groups[{i}]: {exc}") from None
    out = {k: getattr(checked, k) for k in OVERRIDES}
    out.update({k: group[k] for k in LABELS if k in group})
    return out


def _names(i: int, params: Any, by_id: dict[int, str], by_name: dict[str, str]) -> Iterable[str]:
    """The names of group i's trainable parameters: given as the model's Parameter objects or as
    their names (a tied alias names the parameter it shares). Frozen ones are skipped, as torch
    optimizers skip parameters without gradients."""
    if isinstance(params, (torch.Tensor, str)) or not isinstance(params, Iterable):
        raise ConfigError(f"param_groups[{i}]['params']: expected a list of parameters or parameter names, "
                          f"got {type(params).__name__}")
    for p in params:
        if isinstance(p, str):
            if p not in by_name:
                raise ConfigError(f"param_groups[{i}]: the model has no parameter named {p!r}")
            name = by_name[p]
        elif isinstance(p, torch.Tensor):
            if id(p) not in by_id:
                raise ConfigError(f"param_groups[{i}]: a tensor of shape {tuple(p.shape)} that is not one of the "
                                  "model's parameters")
            name = by_id[id(p)]
        else:
            raise ConfigError(f"param_groups[{i}]: expected parameters or names, got {type(p).__name__}")
        yield name


def runs(pieces: list[tuple[str, int, int, int]], group_of: dict[str, int]) -> list[tuple[int, int]]:
    """A shard's runs of one group, `(start offset, group index)`, from its pieces
    `(parameter name, parameter offset, shard offset, numel)`; the first run starts at 0 (leading
    padding, which only a shard of no piece has, takes group 0)."""
    out: list[tuple[int, int]] = []
    for name, _, offset, _ in sorted(pieces, key=lambda pc: pc[2]):
        g = group_of[name]
        if not out:
            out.append((0, g))
        elif out[-1][1] != g:
            out.append((offset, g))
    return out or [(0, 0)]
