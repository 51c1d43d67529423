"""What the training state should cost: the ideal retained bytes of ZeRO, per rank and per tier.

Conventions (bytes per parameter):
- Mixed precision (bf16/fp16), the ZeRO paper's convention: weights 2 (the compute copy, in the
  compute dtype), gradients 2 (compute dtype), optimizer 12 (fp32 master weight + fp32 m + fp32 v).
  Total 16. The optimizer's bytes are its spec's (optim/spec.py; AdamW's in optim/adamw.py): every
  figure below is AdamW's, and another optimizer's follow from its state parts.
- fp32 training: weights 4 (the compute copy), gradients 4, optimizer 12 (fp32 master + m + v).
  Total 20. The master is counted apart from the compute copy because that is what an offloading
  engine holds: the compute copy lives with the model (device), the master shard with the
  optimizer state (possibly host or NVMe). Only a device-resident, unpartitioned optimizer could
  alias the two; we do not, so retained equals ideal.

Partitioning across the D data-parallel ranks is cumulative: stage 1 partitions the optimizer
group, stage 2 also the gradients, stage 3 also the weights. So per rank:
  M0 = 16P, M1 = 4P + 12P/D, M2 = 2P + 14P/D, M3 = 16P/D   (mixed precision).
Offloading is a separate choice: it moves a group's bytes from the device column to the host
(pinned RAM, same dtype) or NVMe (same dtype) column without changing their number. Tiers hold
the dtype of their group: weights in the compute dtype, gradients in the compute dtype,
optimizer state in fp32.

These are IDEAL RETAINED bytes: they exclude activations, gathered (unsharded) units at stage 3,
communication buckets, staging buffers, padding to a multiple of D, and allocator overhead.
They are not a peak-memory prediction; the engine's memory report shows both side by side.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Mapping

from zero_offload.optim.adamw import ADAMW
from zero_offload.optim.spec import OptimizerSpec
from zero_offload.tiers import CPU, DEVICE, REGISTRY, TIERS, tier

GROUPS = ("weights", "gradients", "optimizer")
TIER_OF_GROUP = {"weights": "params", "gradients": "grads", "optimizer": "optimizer"}
TIER_COLUMNS = TIERS  # one column per tier, in the registry's order
EXCLUDED = ("activations", "gathered (unsharded) units at stage 3", "communication buckets",
            "staging buffers", "padding to a multiple of D", "allocator overhead")


def bytes_per_param(precision: str, spec: OptimizerSpec = ADAMW) -> dict[str, int]:
    """Bytes per parameter of each state group under `precision` (see the module docstring); the
    optimizer's are its spec's state bytes per element."""
    if precision == "fp32":
        return {"weights": 4, "gradients": 4, "optimizer": spec.bytes_per_element}
    if precision in ("bf16", "fp16"):
        return {"weights": 2, "gradients": 2, "optimizer": spec.bytes_per_element}
    raise ValueError(f"precision {precision!r} is not one of fp32, bf16, fp16")


def partitioned(group: str, stage: int) -> bool:
    """Whether ZeRO `stage` partitions `group` across ranks (cumulative: optimizer, grads, weights)."""
    return stage >= {"optimizer": 1, "gradients": 2, "weights": 3}[group]


@dataclass(frozen=True)
class Ledger:
    """Ideal retained bytes of one rank, by state group and tier, plus whole-machine totals.

    per_rank[group][tier] is exact (a Fraction when P does not divide by D). ranks_per_node is the
    number of ranks that share one machine's host RAM and NVMe drive.
    """

    params: int
    dp: int
    stage: int
    precision: str
    tiers: dict[str, str]
    ranks_per_node: int
    per_rank: dict[str, dict[str, Fraction]]

    def group_total(self, group: str) -> Fraction:
        return sum(self.per_rank[group].values(), Fraction(0))

    def tier_total(self, tier: str) -> Fraction:
        """Bytes one rank keeps on `tier` ('device', 'cpu' or 'nvme')."""
        return sum((self.per_rank[g][tier] for g in GROUPS), Fraction(0))

    @property
    def total(self) -> Fraction:
        return sum((self.group_total(g) for g in GROUPS), Fraction(0))

    def machine_total(self, tier: str) -> Fraction:
        """Bytes all ranks of one machine keep on a shared tier (host RAM or the NVMe drive)."""
        return self.tier_total(tier) * self.ranks_per_node

    def as_dict(self) -> dict:
        """JSON-ready: integers where exact, floats otherwise."""
        return {
            "params": self.params, "dp": self.dp, "stage": self.stage, "precision": self.precision,
            "tiers": dict(self.tiers), "ranks_per_node": self.ranks_per_node,
            "per_device": {**{g: _num(self.group_total(g)) for g in GROUPS}, "total": _num(self.total)},
            "per_rank_by_tier": {t: {**{g: _num(self.per_rank[g][t]) for g in GROUPS},
                                     "total": _num(self.tier_total(t))} for t in TIER_COLUMNS},
            "machine": {t.name: _num(self.machine_total(t.name)) for t in REGISTRY if t.machine_shared},
            "excludes": list(EXCLUDED),
        }


def _num(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _check_int(name: str, value: object, low: int) -> None:
    # bool is an int subclass: params=True would count as P = 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_ranks_per_node(ranks_per_node: int, dp: int) -> None:
    """Ranks on one machine are some of the D ranks: more would multiply the machine totals by
    ranks that do not exist."""
    _check_int("ranks_per_node", ranks_per_node, 1)
    if ranks_per_node > dp:
        raise ValueError(f"ranks_per_node must be <= dp = {dp} (the ranks of all machines), got {ranks_per_node}")


def _check_tiers(tiers: Mapping[str, str] | None) -> dict[str, str]:
    """Every group's tier, checked: an unknown tier would drop the group's bytes from every
    column (per-tier totals would no longer add up), and a misspelt group would be ignored."""
    if tiers is None:
        tiers = {}
    if not isinstance(tiers, Mapping):
        raise ValueError(f"tiers must be a mapping of group -> tier, got {tiers!r}")
    keys = tuple(TIER_OF_GROUP.values())
    for key, tier in tiers.items():
        if key not in keys:
            raise ValueError(f"tiers key {key!r} is not one of {', '.join(keys)}")
        if not isinstance(tier, str) or tier not in TIER_COLUMNS:
            raise ValueError(f"tiers[{key!r}] = {tier!r} is not one of {', '.join(TIER_COLUMNS)}")
    return {**{k: DEVICE.name for k in keys}, **tiers}


def ideal(params: int, dp: int, stage: int, precision: str = "bf16", tiers: Mapping[str, str] | None = None,
          ranks_per_node: int | None = None, spec: OptimizerSpec = ADAMW, weights_in_cpu: int = 0) -> Ledger:
    """The ideal retained bytes per rank for P=`params`, D=`dp` at ZeRO `stage`.

    `tiers` maps 'params'/'grads'/'optimizer' to 'device'/'cpu'/'nvme' (default: all on device).
    `ranks_per_node` defaults to D (one machine) and may not exceed it. `spec`: the optimizer
    whose state is counted (AdamW's master, m and v by default). `weights_in_cpu`: weight
    elements of each rank kept in host RAM though the params tier is nvme (stage3.max_in_cpu).
    """
    _check_int("params", params, 0)
    _check_int("dp", dp, 1)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if ranks_per_node is not None:
        _check_ranks_per_node(ranks_per_node, dp)
    tiers = _check_tiers(tiers)
    per_param = bytes_per_param(precision, spec)
    per_rank: dict[str, dict[str, Fraction]] = {}
    for group in GROUPS:
        share = Fraction(params, dp) if partitioned(group, stage) else Fraction(params)
        per_rank[group] = {t: Fraction(0) for t in TIER_COLUMNS}
        per_rank[group][tiers[TIER_OF_GROUP[group]]] = share * per_param[group]
    _keep_in_cpu(per_rank["weights"], tiers["params"], weights_in_cpu, per_param["weights"])
    return Ledger(params, dp, stage, precision, tiers, dp if ranks_per_node is None else ranks_per_node, per_rank)


def _keep_in_cpu(row: dict[str, Fraction], params_tier: str, elements: int, per_element: int) -> None:
    """Up to `elements` of the weights' share move from an nvme params tier to host RAM."""
    _check_int("weights_in_cpu", elements, 0)
    if not elements or not tier(params_tier).needs_nvme_paths:
        return
    moved = min(Fraction(elements * per_element), row[params_tier])
    row[params_tier] -= moved
    row[CPU.name] += moved


def formula(params: int, dp: int, stage: int, spec: OptimizerSpec = ADAMW) -> Fraction:
    """The seed's closed forms (mixed precision, weights W = 2 and gradients G = 2 bytes, the
    optimizer's O bytes per parameter): (W+G+O)P, (W+G)P + OP/D, WP + (G+O)P/D, (W+G+O)P/D --
    for AdamW (O = 12) 16P, 4P + 12P/D, 2P + 14P/D, 16P/D."""
    b = bytes_per_param("bf16", spec)
    w, g, o = b["weights"], b["gradients"], b["optimizer"]
    p, d = Fraction(params), Fraction(dp)
    return [(w + g + o) * p, (w + g) * p + o * p / d, w * p + (g + o) * p / d, (w + g + o) * p / d][stage]
