"""The memory report: per tier x state group, the ledger's ideal beside what the engine holds.

Columns: ideal (ledger.ideal: per-rank bytes of ZeRO with nothing else), retained (bytes the
engine's stores and compute copy hold now), peak (their high-water mark since initialize). Rows
below name every other allocation: padding, NVMe slot rounding (slots are whole pages), staging
buffers, the gradient bucket in flight, the updated weights held at step() before they are
installed (stages 0-2);
then the process-level figures (torch.cuda.max_memory_allocated on a
GPU, the process RSS via psutil). For weights and optimizer state, retained minus ideal is exactly
the sum of the rows named for that group: padding (each bucket or unit is padded to a multiple of
D x 16 elements, so every rank's shard has one size, where the ledger splits P evenly: the padding
is zero only when every bucket's or unit's size is such a multiple), NVMe slot rounding (slots are
whole pages), and at stage 3 the frozen parameters, which the ledger does not count. Gradients
differ by design: without clipping, fp16 or accumulation the overlapped step consumes each grad
shard as it arrives (retained 0), and stage 1 keeps only its grad shard where the ledger counts
every gradient; the padding in what is held is named.
"""
from __future__ import annotations

from typing import Any

import psutil
import torch

from zero_offload import comm, ledger
from zero_offload.ledger import GROUPS
from zero_offload.tiers import TIERS
from zero_offload.config import Config
from zero_offload.engine.runtime import Runtime


def _mib(n: float) -> str:
    return f"{n / 2**20:10.3f}"


def memory_report(rt: Runtime, cfg: Config, device: torch.device) -> dict[str, Any]:
    """The report as a dict; its 'table' entry is the printable form. The runtime names its
    bytes (retained, extras, limits); the rows, notes and table are assembled here."""
    led = ledger.ideal(rt.trainable_numel(), comm.world_size(), cfg.stage, cfg.precision.dtype,
                       {"params": cfg.tiers.params, "grads": cfg.tiers.grads, "optimizer": cfg.tiers.optimizer},
                       spec=rt.shard_optimizer.spec,  # the engine's optimizer's bytes per element
                       weights_in_cpu=cfg.stage3.max_in_cpu if cfg.stage == 3 else 0)
    held = rt.retained()
    rows = []
    for group in GROUPS:
        for tier in TIERS:
            ideal = float(led.per_rank[group][tier])
            now, peak = held.get((group, tier), (0, 0))
            if ideal or now or peak:
                rows.append({"group": group, "tier": tier, "ideal": ideal, "retained": now, "peak": peak,
                             "difference": now - ideal})
    other = rt.extras()
    process = {"rss": psutil.Process().memory_info().rss}
    if torch.cuda.is_available() and device.type == "cuda":
        process["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        process["cuda_memory_allocated"] = torch.cuda.memory_allocated(device)
    report = {"params": rt.trainable_numel(), "world": comm.world_size(), "stage": cfg.stage,
              "precision": cfg.precision.dtype, "rows": rows, "other": other, "limits": rt.limits(), "process": process}
    report["notes"] = _notes(rows, cfg.stage, rt.shard_optimizer.eager)
    report["table"] = _table(report)
    return report


def _table(r: dict[str, Any]) -> str:
    head = (f"memory per rank (MiB): P={r['params']} D={r['world']} stage={r['stage']} {r['precision']}\n"
            f"{'group':10} {'tier':7} {'ideal':>10} {'retained':>10} {'peak':>10} {'retained-ideal':>14}")
    lines = [head]
    for row in r["rows"]:
        lines.append(f"{row['group']:10} {row['tier']:7} {_mib(row['ideal'])} {_mib(row['retained'])} "
                     f"{_mib(row['peak'])} {_mib(row['difference']):>14}")
    lines += [f"  note: {note}" for note in r["notes"]]
    lines.append("not in the ledger:")
    lines += [f"  {name:60} {_mib(n)}" for name, n in r["other"].items()]
    lines.append("process (measured):")
    lines += [f"  {name:60} {_mib(n)}" for name, n in r["process"].items()]
    if r["limits"]:
        lines.append("limits (configured, not held):")
        lines += [f"  {name:60} {_mib(n)}" for name, n in r["limits"].items()]
    return "\n".join(lines)


def _notes(rows: list[dict[str, Any]], stage: int, eager: bool) -> list[str]:
    """Why a group holds less than the ledger says, where that is by design."""
    grads = [r for r in rows if r["group"] == "gradients"]
    if not grads or sum(r["retained"] for r in grads) >= sum(r["ideal"] for r in grads):
        return []
    why = []
    if stage == 1:
        why.append("stage 1 keeps only this rank's grad shard (the ledger counts every gradient)")
    if eager:
        why.append("the overlapped step consumes each grad shard as it arrives (no clipping, fp16 or "
                   "accumulation), so none is held between steps")
    return [f"gradients below ideal: {'; '.join(why)}"] if why else []
